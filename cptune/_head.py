"""The loss without the whole logits: a causal LM's next-token loss taken from its final hidden states and its LM head
in chunks of tokens, never holding the (tokens x vocabulary) logits, their float32 copy or their gradient at once.

A transformers causal LM's head is its ``lm_head`` and what its forward does to the logits before the loss; the rule
(:func:`head_of`) reads that forward's own code between the ``lm_head`` call and the loss, and knows four transforms
by the config field they read: ``logits_scaling`` (Granite divides), ``logit_scale`` (Cohere multiplies),
``lm_head_multiplier`` (Falcon-H1 multiplies) and ``final_logit_softcapping`` (Gemma 2 and 3: ``c * tanh(z / c)``).
Any other statement on the logits there is a head cptune cannot chunk exactly: it is named, and that model keeps the
whole-logits loss.

Two paths (:func:`loss_sum`): a head that is a matrix product times a constant goes to torch's chunked
``torch.nn.functional.linear_cross_entropy`` ("torch"); softcapping, a bias, or a torch without it, to cptune's own
chunks, each recomputed in backward (activation checkpointing per chunk: "cptune"). Imports nothing of cptune's.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_BYTES = 2 ** 27
"""The float32 logits of one chunk, both paths: 128 MiB, 512 tokens of a 65,536-word vocabulary (at least
MIN_CHUNK tokens). torch's own choice on a CPU (its "auto", aspect-ratio chunks) took 1.35x the whole logits' time
at 8192 tokens x hidden 512 x vocabulary 65,536; chunks of 512 tokens took 0.85x (``benchmarks.loss``)."""
MIN_CHUNK = 128
_KNOWN = {"final_logit_softcapping": "softcap", "logits_scaling": "divide", "logit_scale": "multiply",
          "lm_head_multiplier": "multiply"}


@dataclass(frozen=True)
class Head:
    """A head cptune can chunk: logits = scale * (hidden @ weight.T + bias), then ``softcap * tanh(z / softcap)``."""

    scale: float = 1.0
    softcap: float | None = None


def _statements(model: torch.nn.Module) -> list[str] | None:
    """The lines of the model's forward from its ``lm_head`` call to its loss (None: no such call found)."""
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return None
    lines = source.splitlines()
    start = next((i for i, line in enumerate(lines) if "self.lm_head(" in line), None)
    if start is None:
        return None
    out = []
    for line in lines[start:]:
        if re.search(r"\bloss\b", line) and line is not lines[start]:
            break
        out.append(line.strip())
    return out


def head_of(model: torch.nn.Module) -> Head | str:
    """``model``'s head as cptune chunks it, or why it cannot (a sentence)."""
    statements = _statements(model)
    if statements is None:
        return f"{type(model).__name__}'s forward has no lm_head call cptune can read"
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    scale, softcap = 1.0, None
    for line in statements:
        if not re.search(r"\blogits\b", line) or line.startswith(("#", "if ")):
            continue
        known = [field for field in _KNOWN if field in line]
        code = line.split("#")[0].strip()
        if not known and code in ("logits = torch.tanh(logits)", "logits = logits.float()"):  # softcap's middle; upcast
            continue
        if not known and "self.lm_head(" in line and re.fullmatch(r"logits = self\.lm_head\([^()]*\)", code):
            continue
        if not known:
            return f"{type(model).__name__}'s forward does {line!r} to the logits, which cptune's chunked loss does " \
                   "not know"
        for field in known:
            value = getattr(config, field, None)
            if value is None:
                continue
            if _KNOWN[field] == "softcap":
                softcap = float(value)
            elif _KNOWN[field] == "divide":
                scale /= float(value)
            else:
                scale *= float(value)
    return Head(scale=scale, softcap=softcap)


def _chunk_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
               scale: float, softcap: float | None, ignore_index: int) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float() * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def chunk_tokens_for(vocab: int) -> int:
    """Tokens a chunk: CHUNK_BYTES of float32 logits, at least MIN_CHUNK."""
    return max(MIN_CHUNK, CHUNK_BYTES // (4 * vocab))


def loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, head: Head = Head(),
             bias: torch.Tensor | None = None, ignore_index: int = -100, chunk_tokens: int | None = None,
             path: str | None = None) -> tuple[torch.Tensor, str]:
    """(the sum of the next-token losses of ``hidden`` (..., H) against ``labels`` (...), pre-shifted; the path that
    ran: "torch" or "cptune"), in float32, never the whole logits. ``chunk_tokens``: default
    :func:`chunk_tokens_for` the vocabulary. ``path``: "cptune" takes cptune's own chunks where torch's would apply
    (the benchmark compares them)."""
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    chunk_tokens = chunk_tokens or chunk_tokens_for(weight.shape[0])
    torch_path = head.softcap is None and bias is None and hasattr(F, "linear_cross_entropy")
    if torch_path and path != "cptune":
        options = torch.nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=chunk_tokens)
        total = F.linear_cross_entropy(hidden.float() * head.scale, weight.float(), labels, reduction="sum",
                                       ignore_index=ignore_index, options=options)
        return total, "torch"
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        piece = slice(start, start + chunk_tokens)
        total = total + checkpoint(_chunk_sum, hidden[piece], weight, bias, labels[piece], head.scale, head.softcap,
                                   ignore_index, use_reentrant=False)
    return total, "cptune"
