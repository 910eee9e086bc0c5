"""The step model's terms for a hybrid's layers that mix tokens outside softmax attention (Gated DeltaNet, Mamba2,
short convolutions: :class:`~cptune.plan._dims.MixerDims`), per rank and per such layer, on the path cptune takes
(:mod:`cptune.mixers._choice`):

* ``heads`` (Gated DeltaNet, Mamba2 where their heads divide by cp): the projections on this rank's tokens, the
  recurrence on cp-th of the heads over the whole sequence (the same FLOPs and activations per rank as S/cp tokens
  of every head), two all-to-alls each way (the recurrence's inputs in, its output back; Mamba2's B and C gathered
  whole);
* ``halo`` (short convolutions): this rank's tokens, a few tokens exchanged (latency only);
* ``generic`` (``mixers: whole``, or heads that do not divide): the module on the whole gathered sequence on every
  rank (its projections, recurrence and activations cp times a split rank's), the input all-gathered forward and its
  gradient all-reduced backward;
* at cp = 1: this rank's tokens, nothing exchanged.

Linear-time compute: a chunked kernel's FLOPs per token, ``2 * chunk * (key + value width) + 4 * state`` (the
intra-chunk products and the state's read and update), at the attention kernel's rate, backward 2.5x forward as for
attention; the projections at the GEMM rate. Kept for backward per token: the projections, the convolution's output,
the recurrence's inputs and output (``2 * width + 2 * (key + value width)`` elements); flash-linear-attention and
mamba-ssm recompute their chunk states in backward, so none are kept. A first-principles estimate, not yet calibrated
on a GPU (cptune's ``python -m benchmarks.hybrid_memory`` measures the CPU paths).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._dims import MixerDims


def path(mixer: MixerDims, cp: int, mixers: str) -> str:
    """The path ``mixer``'s layers take under ``cp`` ranks and ``CPConfig.mixers`` (:func:`cptune.mixers._choice.path`'s
    rule on the config's numbers)."""
    if cp == 1:
        return "local"
    if mixers == "whole" or not mixer.fits(cp):
        return "generic"
    return "halo" if mixer.kind == "short_conv" else "heads"


@dataclass(frozen=True)
class MixerTerms:
    """One mixer layer on one rank: forward FLOPs (projections, recurrence), bytes kept for backward, and what a
    forward and a backward each move over cp (bytes this rank receives, messages)."""

    path: str
    dense_flops: float
    recurrence_flops: float
    kept_bytes: float
    forward_bytes: float
    backward_bytes: float
    messages: int


def terms(mixer: MixerDims, path_taken: str, tokens: int, cp: int, hidden: int, itemsize: int) -> MixerTerms:
    """:class:`MixerTerms` for ``tokens`` of this rank's (the sequence's S/cp) under ``path_taken``."""
    whole = path_taken == "generic"
    seen = tokens * cp if whole else tokens  # the tokens (of every head) whose work this rank does
    recurrence = seen * (2 * mixer.chunk * (mixer.key_width + mixer.value_width) + 4 * mixer.state)
    if mixer.kind == "short_conv":
        recurrence = seen * 2 * 3 * hidden * 3  # B*x, its taps and C*y: elementwise-sized, priced here all the same
    kept = seen * (2 * mixer.width + 2 * (mixer.key_width + mixer.value_width)) * itemsize
    forward = backward = 0.0
    messages = 0
    if whole:  # the input all-gathered; backward its whole gradient all-reduced (2 x (cp - 1) / cp of it)
        kept += tokens * cp * hidden * itemsize
        forward = tokens * (cp - 1) * hidden * itemsize
        backward = 2 * tokens * cp * hidden * itemsize * (cp - 1) / cp
        messages = cp - 1
    elif path_taken == "heads":
        forward = backward = tokens * (mixer.exchanged * (cp - 1) / cp + mixer.gathered * (cp - 1)) * itemsize
        kept += tokens * cp * mixer.gathered * itemsize
        messages = 2 * (cp - 1) + (cp - 1 if mixer.gathered else 0)
    elif path_taken == "halo":
        messages = cp - 1
    return MixerTerms(path_taken, 2 * seen * mixer.params, recurrence, kept, forward, backward, messages)
