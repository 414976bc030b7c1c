"""`python -m remat` runs the remat command line."""

from remat.cli import main

main()
