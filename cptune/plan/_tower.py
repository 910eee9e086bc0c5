"""A vision-language model's tower in the step model (:func:`cptune.plan._step.predict`).

Its parameters are held as the model's others (FSDP2 shards them: the root's share). With a video workload
(``Workload.video``: a video of T x H x W patches a row) each CP rank encodes its share of the temporal patches, dealt
evenly by :mod:`cptune.vision` (``ceil(T * batch / cp)`` of them on the busiest rank), and receives the rows of the
placeholders it holds (``T * H * W / merge²`` a row, split over cp like the sequence): the tower's matmuls over its
patches, its attention within each temporal patch (``n²`` pairs for ``n = H x W`` patches; Qwen2.5-VL's windowed
blocks attend less, so this is an upper bound), what autograd keeps of each block, and the all-to-all of the rows,
forward and backward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from ..config import StrictModel


class TowerDims(StrictModel):
    """The tower: ``depth`` blocks of attention (``heads``) and an MLP (``mats`` matrices ``ffn`` wide: 3 gated) on
    rows ``width`` wide; a patch embedding from ``patch`` pixel values (and Qwen3-VL's learned positions); a merger of
    ``merge`` x ``merge`` patches into one row ``out`` wide (and ``extra_mergers`` more: Qwen3-VL's deepstack)."""

    depth: int = Field(gt=0)
    width: int = Field(gt=0)
    ffn: int = Field(gt=0)
    heads: int = Field(gt=0)
    mats: int = Field(2, gt=0)
    merge: int = Field(1, gt=0)
    patch: int = Field(gt=0)
    out: int = Field(gt=0)
    extra_mergers: int = Field(0, ge=0)

    @property
    def block_params(self) -> int:
        return 4 * self.width * self.width + self.mats * self.width * self.ffn + 4 * self.width

    @property
    def merger_params(self) -> int:
        merged = self.width * self.merge * self.merge
        return merged * merged + merged * self.out

    @property
    def params(self) -> int:
        return self.depth * self.block_params + self.patch * self.width + \
            (1 + self.extra_mergers) * self.merger_params


def tower_from_fields(data: Mapping[str, Any]) -> TowerDims | None:
    """The tower of a config's ``vision_config`` (Qwen2-VL's ``embed_dim`` and ``mlp_ratio``, Qwen2.5-VL's and
    Qwen3-VL's ``hidden_size`` and ``intermediate_size``), or None for a model without one."""
    vision = data.get("vision_config")
    if not isinstance(vision, Mapping) or not vision.get("depth"):
        return None
    width = int(vision.get("embed_dim") or vision["hidden_size"])
    ffn = int(vision.get("intermediate_size") or width * float(vision.get("mlp_ratio", 4)))
    out = int(vision.get("out_hidden_size") or (vision["hidden_size"] if vision.get("embed_dim") else width))
    patch = int(vision.get("in_channels", vision.get("in_chans", 3))) * int(vision.get("temporal_patch_size", 1)) * \
        int(vision.get("patch_size", 14)) ** 2
    return TowerDims(depth=int(vision["depth"]), width=width, ffn=ffn, heads=int(vision.get("num_heads", 16)),
                     mats=3 if vision.get("hidden_act") == "silu" else 2,
                     merge=int(vision.get("spatial_merge_size", 1)),
                     patch=patch + int(vision.get("num_position_embeddings", 0)), out=out,
                     extra_mergers=len(vision.get("deepstack_visual_indexes") or ()))


@dataclass(frozen=True)
class TowerStep:
    """The busiest rank's tower work in one step."""

    dense_flops: float
    """Forward matmuls."""
    attention_flops: float
    """Forward attention within each temporal patch."""
    kept_bytes: float
    """What autograd keeps of the tower for backward."""
    largest_bytes: float
    """One block's activations (backward holds them besides what is kept)."""
    trade_bytes: float
    """The rows it receives (and sends: the same in a balanced step), one way, forward."""


def terms(tower: TowerDims, grid: tuple[int, int, int], batch: int, cp: int, e: int, ac: str) -> TowerStep:
    """The busiest rank's tower work; ``ac``: the blocks' checkpointing (cptune's build checkpoints the tower's
    blocks as the language model's layers: full keeps a block's input, selective its matmuls' outputs)."""
    t, h, w = grid
    units = math.ceil(t * batch / cp)  # the busiest rank's temporal patches
    n = h * w
    patches = units * n
    dense = 2 * patches * (tower.depth * (tower.block_params - 4 * tower.width) + tower.patch * tower.width) + \
        2 * patches / (tower.merge ** 2) * (1 + tower.extra_mergers) * tower.merger_params
    attention = 4 * tower.depth * units * n * n * tower.width
    block = (10 * tower.width + (tower.mats + 1) * tower.ffn) * e  # per patch: norms, q k v, out, the MLP's
    kept_block = {"none": block, "selective": (5 * tower.width + tower.mats * tower.ffn) * e, "full": tower.width * e}
    kept = patches * (tower.depth * kept_block[ac] + tower.patch * e)
    rows = t * batch * n / (tower.merge ** 2) / cp
    return TowerStep(dense, attention, kept, patches * block, rows * tower.out * (1 + tower.extra_mergers) * e)


def seconds(seen: TowerStep, gemm_rate: float, attention_rate: float, ac: str) -> float:
    """The tower's compute: forward, backward (twice the matmuls, 2.5x the attention), full AC's recompute."""
    again = 1 if ac == "full" else 0
    return (3 + again) * seen.dense_flops / gemm_rate + (3.5 + again) * seen.attention_flops / attention_rate
