"""``cptune.verify``, the first-step check: a model run twice on a short sequence on the user's own ranks, mesh and configuration,
once as one process runs it (the whole sequence on every rank) and once split over cp as configured, outputs and
gradients compared. A model's code can read a shard's shapes, positions or masks anywhere (``torch.arange(x.shape[1])``
is enough), and no rule over module types sees it; this sees what it does.

What is compared (each a relative error, ``|split - whole| / |whole|`` over the whole tensor):

* each decoder layer's output and the model's final hidden states (what the LM head reads), every position, each
  through a fixed random projection to :data:`SKETCH` numbers a token (a difference anywhere in a token's vector shows
  in its projection);
* the gradient of the input embeddings' output, every position, likewise;
* every parameter's gradient, as the optimizer would see it (FSDP2's reduced shards; without FSDP, averaged over the
  cp ranks as the user averages them);
* the loss.

The verdict is one for all ranks (the errors are the most over every rank). Dropout and other randomness are off for
the check, the random number generators and the gradients the user had are as before afterwards.
"""

from ._report import MARGIN, NOISE, SKETCH, TOKENS, TOLERANCE, CheckReport, Measure, agree, assess, check_tokens, \
    judge, layout_label, raised_problem, reaches, relative, timed, where_raised
from ._step import check
from ._runs import Probes, average_over, grad_errors, opened, per_rank, perturbed, quiet, set_aside, sketch, \
    take_grads

__all__ = ["MARGIN", "NOISE", "SKETCH", "TOKENS", "TOLERANCE", "CheckReport", "Measure", "Probes", "agree", "assess",
           "average_over", "check", "check_tokens", "grad_errors", "judge", "layout_label", "opened", "per_rank", "perturbed",
           "quiet",
           "raised_problem", "reaches", "relative", "set_aside", "sketch", "take_grads", "timed", "where_raised"]
