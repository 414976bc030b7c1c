"""`python -m remat.cli` (and `torchrun -m remat.cli`) runs the remat command line."""

from remat.cli import main

main()
