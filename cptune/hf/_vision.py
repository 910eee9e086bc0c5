"""Vision-language models under CP: the tower's frames split over the ranks, their embeddings sent to the ranks that
hold their placeholders (:mod:`cptune.vision`), the language model under CP as any other.

What transformers' code does, and what cptune changes inside a block of cp > 1:

* ``input_ids``, the labels and the position ids are the block's buffers, split over cp; ``pixel_values`` /
  ``pixel_values_videos`` and their ``*_grid_thw`` are passed whole, as the processor made them;
* the model asks its own ``get_image_features`` / ``get_video_features`` for the rows of every image or video. cptune's
  wrapper of them (installed by :func:`prepare`) runs the tower on this rank's units only (one temporal patch of an
  image or video each, dealt by cost: :func:`cptune.vision.deal`) and hands back, through one all-to-all, exactly
  the rows of the placeholders this rank holds, in its order (Qwen3-VL's deepstack features alike). The model then
  fills its shard's placeholders with them (its own ``masked_scatter``), as it fills the whole batch's in one process;
* the positions are M-RoPE's (time, height, width), made over the whole sequence before it is split:
  :func:`position_ids` (the model's own ``get_rope_index``, restarting at each packed document), as a (3, B, S)
  buffer split along dim 2, or (4, B, S) with the text positions first for a packed batch (transformers' way);
* the tower's attention (within one image or frame) runs as torch's own SDPA on the rank's images, never the block's.

A family takes this path when its model holds a ``visual`` tower that attends within each temporal patch and a
``get_rope_index`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE), and the support matrix has proven its vision rows
(:mod:`cptune.hf._check`'s file). Any other vision-language model is refused by name under cp > 1 when it is given
images or video; its text-only calls run as any language model.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from .. import vision as V
from .._session import active
from ..errors import Problem, raise_if
from ..mixers import per_image_parts

PIXELS = ("pixel_values", "pixel_values_videos")
"""The call's arguments that carry images or video."""
_GRIDS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}


def inner(model: nn.Module) -> nn.Module | None:
    """The module that holds a vision-language model's tower and language model (``model.model`` of a
    ``...ForConditionalGeneration``), or None for a model without one."""
    for _, module in model.named_modules():
        if hasattr(type(module), "get_image_features") and (hasattr(module, "language_model") or
                                                             hasattr(module, "text_model")):
            return module
    return None


def splits_tower(model: nn.Module) -> bool:
    """Whether cptune splits this family's tower by temporal patches (the module docstring's rule)."""
    found = inner(model)
    return found is not None and hasattr(found, "visual") and hasattr(found, "get_rope_index") \
        and hasattr(found.visual, "spatial_merge_size")


def prepare(model: nn.Module) -> None:
    """Mark the per-image parts (their attention runs as torch's own SDPA inside a block) and wrap the tower's calls;
    again on a prepared model, nothing new."""
    found = inner(model)
    if found is None:
        return
    outside = getattr(model, "_cptune_outside", "sdpa")
    for path in per_image_parts(model):
        for module in model.get_submodule(path).modules():
            module._cptune_per_image = outside
    if not splits_tower(model) or getattr(found, "_cptune_split", False):
        return
    for modality in _GRIDS:
        name = f"get_{modality}_features"
        original = getattr(type(found), name).__get__(found)
        setattr(found, name, functools.partial(_split_call, found, modality, original))
    found._cptune_split = True


def per_image_attention(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """A tower's attention (within one image or frame): the implementation the model runs outside blocks, with the
    block's SDPA hook set aside."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = module._cptune_per_image
    run = ALL_ATTENTION_FUNCTIONS[implementation if implementation in ALL_ATTENTION_FUNCTIONS else "sdpa"]
    session = active()
    if session is None:
        return run(module, *args, **kwargs)
    with session.own_attention():
        return run(module, *args, **kwargs)


def call_problems(model: nn.Module, session: Any, given: dict[str, Any]) -> list[Problem]:
    """What a vision-language call inside a block of cp > 1 cannot run as given (before any collective)."""
    if not any(given.get(name) is not None for name in PIXELS):
        return []
    found, name = inner(model), type(model).__name__
    if found is None:
        return []
    import transformers

    if transformers.__version__.startswith("4."):
        return [Problem("pixel_values", f"is given to {name} under cp={session.cp} with transformers "
                        f"{transformers.__version__}, whose vision-language models cptune does not split over CP ranks",
                        "use transformers 5 (its tower calls return the rows cptune trades), or cp=1")]
    if not splits_tower(model):
        return [Problem("pixel_values", f"is given to {name} under cp={session.cp}, whose vision part cptune does not "
                        "split over CP ranks (cptune splits towers that attend within each image or frame and place "
                        "their rows by M-RoPE positions: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE)",
                        "train this model with cp=1 (data parallelism, FSDP2 or tp), or a Qwen-VL family")]
    from ._check import proven_vision

    if not proven_vision(model) and getattr(model, "_cptune_check", "auto") != "never":
        return [Problem("pixel_values", f"is given to {name} under cp={session.cp}, a family whose vision rows "
                        "cptune's support matrix has not proven on this transformers release",
                        "train it with cp=1; or, if you have verified it yourself (python -m "
                        "benchmarks.matrix_vision), cptune.hf.enable(model, check='never')")]
    problems = []
    positions = given.get("position_ids")
    if positions is not None and (positions.ndim != 3 or positions.shape[0] not in (3, 4)):
        problems.append(Problem("position_ids", f"is {tuple(positions.shape)} on this rank: {name} places images and video by "
                                "M-RoPE positions (time, height, width), which these are not",
                                "make them over the whole sequence before the block with cptune.hf.position_ids("
                                "model, input_ids, image_grid_thw=..., video_grid_thw=...) and pass them as a buffer "
                                "split along dim 2 (seq_dims 2)"))
    if given.get("input_ids") is None:
        problems.append(Problem("inputs_embeds", f"is given to {name} with images or video under CP, where cptune "
                                "places the tower's rows by the placeholders of input_ids",
                                "pass input_ids (a buffer of the block) and let the model embed them"))
    for modality, (pixels, grid) in _GRIDS.items():
        if given.get(pixels) is not None and given.get(grid) is None:
            problems.append(Problem(grid, f"is not given with {pixels}", f"pass {grid} as the processor made it"))
    return problems


def stash(model: nn.Module, session: Any, given: dict[str, Any]) -> None:
    """Keep the whole batch's placeholders for this forward's tower calls (gathered if ``input_ids`` is not a buffer), after
    checking that its placeholders match the tower's rows."""
    found = inner(model)
    if found is None or not any(given.get(name) is not None for name in PIXELS) or not splits_tower(model):
        return
    ids = given["input_ids"]
    whole = session.full_tensor(ids)
    whole = session.unshard(ids, 1) if whole is None else whole
    whole = whole.detach().cpu()
    # the family's own rule for its placeholders (GLM-4.1V fills a video's frames into image tokens)
    masks = found.get_placeholder_mask(whole, inputs_embeds=torch.zeros(*whole.shape, 1))
    masks = dict(zip(_GRIDS, (m[..., 0] for m in masks)))
    problems = []
    merge = found.visual.spatial_merge_size
    for modality, (pixels, grid) in _GRIDS.items():
        if given.get(pixels) is None:
            continue
        want = int((given[grid].prod(-1) // (merge * merge)).sum())
        have = int(masks[modality].sum())
        if want != have:
            problems.append(Problem("input_ids", f"holds {have} {modality} placeholders but {grid} makes {want} "
                                    f"{modality} rows", f"pass the ids and {grid} the processor made together (every "
                                    f"{modality}'s placeholders in the sequence, none cut off)"))
    raise_if(problems)
    found._cptune_call = (session, masks)


def _split_call(found: nn.Module, modality: str, original: Any, pixels: torch.Tensor, grid: torch.Tensor = None,
                **kwargs: Any) -> Any:
    """The model's own ``get_<modality>_features``, on this rank's units, its rows sent to where they are filled."""
    session = active()
    call = getattr(found, "_cptune_call", None)
    if session is None or session.cp == 1 or call is None or call[0] is not session or \
            getattr(found, "_cptune_in_tower", False):
        return original(pixels, grid, **kwargs)
    tower = found.visual
    width = int(getattr(tower.config, "hidden_size", getattr(tower.config, "embed_dim", 1)))
    units = V.units(grid.cpu(), tower.spatial_merge_size, width)
    owners = V.deal(units, session.cp)
    mine = [u for u, o in zip(units, owners) if o == session.cp_rank]
    run = mine or units[:1]  # a rank dealt nothing runs one unit for nothing: FSDP2 and the gradients see the tower
    rows = torch.cat([pixels[u.rows[0]:u.rows[1]] for u in run])
    sub = torch.tensor([u.grid for u in run], dtype=grid.dtype, device=grid.device)
    found._cptune_in_tower = True
    try:
        out = original(rows, sub, **kwargs)
    finally:
        found._cptune_in_tower = False
    raise_if([] if hasattr(out, "pooler_output") else [Problem(
        "transformers", f"{type(found).__name__}.get_{modality}_features returned {type(out).__name__}, not the "
        "model output with pooler_output that transformers 5 returns", "use transformers 5 for vision-language "
        "models under CP")])
    plan = V.routing(call[1][modality], session.held(), units, owners)

    def send(made: Any) -> torch.Tensor:
        made = torch.cat(list(made)) if isinstance(made, (list, tuple)) else made
        got = V.route(made if mine else made[:0], plan, session.cp_rank, session.group)
        return got if mine else got + 0 * made.sum()

    out.pooler_output = (send(out.pooler_output),)
    if getattr(out, "deepstack_features", None) is not None:
        out.deepstack_features = [(send(f),) for f in out.deepstack_features]
    return out


def position_ids(model: nn.Module, input_ids: torch.Tensor, *, image_grid_thw: torch.Tensor | None = None,
                 video_grid_thw: torch.Tensor | None = None, second_per_grid_ts: torch.Tensor | None = None,
                 mm_token_type_ids: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """A vision-language model's M-RoPE positions over the whole sequence (before the block splits it): the model's
    own ``get_rope_index``. (3, B, S); with ``documents`` ((B, S) ids of packed samples), each sample numbered from 0
    as in its own batch, and the text positions first: (4, B, S), as transformers reads a packed multimodal batch.
    ``mm_token_type_ids``: the processor's (default: 1 at the family's image placeholders, 2 at its video ones)."""
    found = inner(model)
    raise_if([] if found is not None and hasattr(found, "get_rope_index") else [Problem(
        "model", f"is {type(model).__name__}, which has no M-RoPE positions (get_rope_index)",
        "give a text model torch.arange positions (restarting at each packed document)")])
    if mm_token_type_ids is None:  # the family's own placeholders: 1 an image's, 2 a video's
        image, video = (m[..., 0] for m in found.get_placeholder_mask(input_ids,
                                                                       inputs_embeds=torch.zeros(*input_ids.shape, 1)))
        raise_if([Problem("mm_token_type_ids", f"is not given, and {type(model).__name__} marks images and video "
                          "with the same placeholder token", "pass the processor's mm_token_type_ids")]
                 if image_grid_thw is not None and video_grid_thw is not None and bool((image & video).any()) else [])
        mm_token_type_ids = torch.zeros_like(input_ids, dtype=torch.int)
        if image_grid_thw is not None:
            mm_token_type_ids[image] = 1
        if video_grid_thw is not None:
            mm_token_type_ids[video] = 2
    rope = functools.partial(found.get_rope_index, second_per_grid_ts=second_per_grid_ts) \
        if second_per_grid_ts is not None else found.get_rope_index
    if documents is None:
        return rope(input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=image_grid_thw,
                    video_grid_thw=video_grid_thw)[0]
    merge = found.visual.spatial_merge_size
    out = torch.zeros(4, *input_ids.shape, dtype=torch.long, device=input_ids.device)
    grids = {1: _Rows(image_grid_thw, merge), 2: _Rows(video_grid_thw, merge, second_per_grid_ts)}
    documents = documents.expand_as(input_ids)
    for b in range(input_ids.shape[0]):
        cuts = torch.nonzero(torch.diff(documents[b]) != 0).flatten().add(1).tolist()
        for a, z in zip([0, *cuts], [*cuts, input_ids.shape[1]]):
            types = mm_token_type_ids[b:b + 1, a:z]
            image, video = grids[1].take(int((types == 1).sum())), grids[2].take(int((types == 2).sum()))
            args = {"image_grid_thw": image[0], "video_grid_thw": video[0]}
            if video[1] is not None:
                args["second_per_grid_ts"] = video[1]
            out[1:, b:b + 1, a:z] = found.get_rope_index(input_ids[b:b + 1, a:z], mm_token_type_ids=types, **args)[0]
            out[0, b, a:z] = torch.arange(z - a)
    return out


class _Rows:
    """A grid's rows taken in order by the placeholders they make (a packed sample's images, then the next's)."""

    def __init__(self, grid: torch.Tensor | None, merge: int, seconds: torch.Tensor | None = None) -> None:
        self.grid, self.seconds, self.next = grid, seconds, 0
        self.sizes = (grid.prod(-1) // (merge * merge)).tolist() if grid is not None else []

    def take(self, tokens: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        start = self.next
        while tokens > 0 and self.next < len(self.sizes):
            tokens -= self.sizes[self.next]
            self.next += 1
        raise_if([] if tokens == 0 else [Problem(
            "documents", "cut an image or video's placeholders between two packed samples",
            "pack whole samples: each image's and video's placeholders inside one document")])
        if self.next == start:
            return None, None
        seconds = self.seconds[start:self.next] if self.seconds is not None else None
        return self.grid[start:self.next], seconds


def video_batch(model: nn.Module, seq_len: int, batch: int, grid: tuple[int, int, int], seed: int = 0) \
        -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Synthetic rows for a vision-language model, as its processor lays out one video among text: (ids, the labels
    shifted with the video's placeholders and marks at -100, the M-RoPE positions (3, B, S), the model's video
    arguments: ``pixel_values_videos`` of seeded noise and ``video_grid_thw``, whole). ``grid``: the video's (T, H, W)
    in patches. A family that numbers a video frame by frame (Qwen3-VL, whose ``get_rope_index`` splits a video's grid
    into its temporal patches) gets one group of placeholders a temporal patch, a text token (its timestamp) between."""
    import inspect

    found = inner(model)
    raise_if([] if found is not None and splits_tower(model) else [Problem(
        "video", f"is given for {type(model).__name__}, which is not a vision-language model cptune splits",
        "give --video with a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE model")])
    config, vision = model.config, model.config.vision_config
    merge, (t, h, w) = found.visual.spatial_merge_size, grid
    per_frame = "repeat_interleave(video_grid_thw" in inspect.getsource(type(found).get_rope_index)
    frame_tokens = h * w // (merge * merge)
    video = t * (frame_tokens + 3) - 1 if per_frame else t * frame_tokens + 2
    raise_if([] if h % merge == 0 and w % merge == 0 and video + 2 <= seq_len else [Problem(
        "video", f"is {t},{h},{w}: {video} tokens with its marks, in a sequence of {seq_len}" if video + 2 > seq_len
        else f"is {t},{h},{w}: height and width must be multiples of the spatial merge ({merge})",
        "give a video that fits the sequence with text around it (fewer or smaller frames), or a longer --seq-len")])
    gen = torch.Generator().manual_seed(seed)
    specials = [config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    vocab = min([config.get_text_config().vocab_size, *specials])
    text = lambda n: torch.randint(0, vocab, (n,), generator=gen)  # noqa: E731
    start, end = torch.tensor([config.vision_start_token_id]), torch.tensor([config.vision_end_token_id])
    rows = []
    for _ in range(batch):
        frames = [start, torch.full((t * frame_tokens,), config.video_token_id), end] if not per_frame else \
            [x for i in range(t) for x in ([text(1)] if i else []) + [start, torch.full((frame_tokens,),
                                                                                        config.video_token_id), end]]
        head = text((seq_len - video) // 4)
        rows.append(torch.cat([head, *frames, text(seq_len - video - len(head))]))
    ids = torch.stack(rows)
    masks = found.get_placeholder_mask(ids, inputs_embeds=torch.zeros(*ids.shape, 1))
    raise_if([] if int(masks[1].sum()) == batch * t * frame_tokens else [Problem(
        "video", f"{type(model).__name__} marks a video's frames with other placeholders than its "
        "video_token_id, which cptune's synthetic rows write", "measure this family with images of your own step "
        "(--workload), or a Qwen-VL family")])
    labels = ids.clone()
    labels[torch.isin(ids, torch.tensor(specials))] = -100
    grids = torch.tensor([grid] * batch)
    channels = getattr(vision, "in_channels", getattr(vision, "in_chans", 3))
    width = channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = torch.randn(batch * t * h * w, width, generator=gen)
    from ..losses import shift_labels

    return ids, shift_labels(labels), position_ids(model, ids, video_grid_thw=grids), \
        {"pixel_values_videos": pixels, "video_grid_thw": grids}
