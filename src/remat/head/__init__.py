"""The language-model head as a plannable part: the output projection and the token loss.

Modules: `loss` (the models' cross-entropy conventions), `chunked` (projection and loss over
chunks of tokens), `site` (finding a model's head: projection, labels, loss), `strategies`
(keep, recompute, chunked:<tokens>: how the head runs), `names` (their names, checked
without torch). Below `remat.measure`, `remat.plan`
and `remat.apply`, which all use it.
"""

__all__ = ["loss", "chunked", "site", "strategies", "names"]
