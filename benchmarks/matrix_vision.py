"""The support matrix's vision-language rows: every transformers family that feeds images or video into a causal
language model, a tiny config from its own config classes, trained under cptune on real ranks with images and video
against one process. Each cell is exact (float32: loss within 1e-5, every parameter gradient, the tower's included,
within 1e-4 of the largest of its tensor) or refused by name; anything else is a failure (``tests/test_vision.py``
runs it in CI and holds docs/transformers.md's table to it).

    python -m benchmarks.matrix_vision                 # prints the rows
    python -m benchmarks.matrix_vision --update-docs   # and writes them into docs/transformers.md and proven.json

Cells, on 2 ranks: "image" (two images, the ring load balanced), "video" (one video of 4 temporal patches, Ulysses),
"packed" (two samples in one row, a video in the first and two images in the second, positions restarting per
sample, the ring load balanced), and on 4 ranks "hybrid, packed" (Ulysses 2 x ring 2). The tower's units are dealt
over the ranks and its rows traded to the ranks that hold their placeholders (:mod:`cptune.vision`). A family whose
tower cptune does not split is refused by name when given images (built on the meta device: the refusal comes before
any compute).
"""

from __future__ import annotations

import sys

import torch

from .matrix import GRAD_TOL, LOSS_TOL, _agreed, _caught, _refused, _relative
from .matrix_docs import proven, write_proven

TEXT = {"vocab_size": 160, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
TOWER = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
         "patch_size": 2, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3}
TOKENS = {"image_token_id": 150, "video_token_id": 151, "vision_start_token_id": 152, "vision_end_token_id": 153}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1}
FAMILIES: dict[str, dict] = {
    # split: a tower that attends within each temporal patch, rows placed by M-RoPE
    "qwen2_vl": {"vision": {"embed_dim": 16, "hidden_size": 32, "mlp_ratio": 2}, "frames": "grouped"},
    "qwen2_5_vl": {"vision": {"window_size": 8, "fullatt_block_indexes": [1]}, "frames": "grouped"},
    "qwen3_vl": {"vision": {"num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]},
                 "text": {"rope_parameters": {**TEXT["rope_parameters"], "mrope_interleaved": True}}},
    "qwen3_vl_moe": {"vision": {"num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]},
                     "text": {**MOE, "rope_parameters": {**TEXT["rope_parameters"], "mrope_interleaved": True}}},
    "glm4v": {"vision": {"out_hidden_size": 32, "num_heads": 2, "image_size": 16},
              "text": {"head_dim": 16, "partial_rotary_factor": 0.5}, "video_token": "image_token_id"},
    # refused under cp > 1 when given images: built on the meta device
    "gemma3": {}, "llava": {}, "llava_onevision": {}, "internvl": {}, "smolvlm": {}, "mistral3": {},
}
CELLS = {"image": ("ring", True, "image", 2), "video": ("ulysses", "auto", "video", 2),
         "packed": ("ring", True, "packed", 2), "hybrid, packed": ("hybrid", True, "packed", 4)}


def tiny_config(family: str):
    """``family``'s tiny config (None: this transformers has no such family); a family cptune does not split keeps
    its config class's defaults (its model is built on the meta device)."""
    import transformers

    if family not in transformers.CONFIG_MAPPING:
        return None
    spec = FAMILIES[family]
    if not _runs(family):
        return transformers.CONFIG_MAPPING[family]()
    config = transformers.CONFIG_MAPPING[family](text_config={**TEXT, **spec.get("text", {})},
                                                 vision_config={**TOWER, **spec["vision"]}, **TOKENS)
    config.use_cache = False
    return config


def _runs(family: str) -> bool:
    """Whether the family's cells run (a family cptune splits, on transformers 5); else they are refusals."""
    import transformers

    return "vision" in FAMILIES[family] and not transformers.__version__.startswith("4.")


def families() -> list[str]:
    return [f for f in FAMILIES if tiny_config(f) is not None]


def build(family: str, seed: int = 0):
    """The family's model: on the CPU from a seed (a split family), or on the meta device."""
    import transformers

    config = tiny_config(family)
    config._attn_implementation = "sdpa"
    cls = transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    if not _runs(family):
        with torch.device("meta"):
            return cls(config)
    torch.manual_seed(seed)
    return cls(config)


def batch(family: str, kind: str, length: int = 64):
    """(ids, model kwargs of the pixels and grids, sample ids or None) of one row: text, a vision start, each image's
    or frame's placeholders, a vision end; a video's frames one group (Qwen2-VL's processor) or a group each with a
    timestamp before it (Qwen3-VL's, GLM-4.1V's)."""
    gen = torch.Generator().manual_seed(5)
    text = lambda n: torch.randint(3, 140, (n,), generator=gen)  # noqa: E731
    start, end = torch.tensor([TOKENS["vision_start_token_id"]]), torch.tensor([TOKENS["vision_end_token_id"]])
    video_grid, image_grid = torch.tensor([[4, 4, 4]]), torch.tensor([[1, 4, 6], [1, 2, 2]])
    per_frame = FAMILIES[family].get("frames") != "grouped"
    frame = TOKENS[FAMILIES[family].get("video_token", "video_token_id")]  # GLM-4.1V: a frame is image tokens
    video = [start, torch.full((16,), frame), end] if not per_frame else \
        [x for i in range(4) for x in ([text(1)] if i else []) + [start, torch.full((4,), frame), end]]
    images = [start, torch.full((6,), TOKENS["image_token_id"]), end, text(3), start,
              torch.full((1,), TOKENS["image_token_id"]), end]
    parts = [text(5), *(video if kind in ("video", "packed") else []), text(4),
             *(images if kind in ("image", "packed") else [])]
    used = sum(len(p) for p in parts)
    ids = torch.cat([*parts, text(length - used)]).view(1, length)
    pixels = lambda grid: torch.randn(int(grid.prod(-1).sum()), 24, generator=gen)  # noqa: E731
    kwargs = {}
    if kind in ("video", "packed"):
        kwargs.update(pixel_values_videos=pixels(video_grid), video_grid_thw=video_grid)
    if kind in ("image", "packed"):
        kwargs.update(pixel_values=pixels(image_grid), image_grid_thw=image_grid)
    samples = None
    if kind == "packed":  # the second sample starts after the video and a little text
        samples = torch.zeros_like(ids)
        samples[:, 5 + sum(len(v) for v in video) + 2:] = 1
    types = torch.zeros_like(ids, dtype=torch.int)  # the processor's mm_token_type_ids: 1 an image's, 2 a video's
    marks = [torch.full_like(p, 2 if any(p is v for v in video) else 1 if any(p is i for i in images) else 0)
             for p in parts]
    types[0, :used] = torch.cat(marks)
    types[ids < TOKENS["image_token_id"]] = 0
    types[ids >= TOKENS["vision_start_token_id"]] = 0
    kwargs["mm_token_type_ids"] = types
    return ids, kwargs, samples


def _cell(family: str, strategy: str, load_balance, kind: str) -> dict:
    import cptune
    import cptune.hf
    import torch.distributed as dist

    world = dist.get_world_size()
    try:
        model = build(family)
    except Exception as exc:  # noqa: BLE001 - transformers cannot build its own config's model (4.56's SmolVLM)
        return {"status": "no reference", "message": f"{type(exc).__name__}: {exc}"[:300]}
    cptune.hf.enable(model, check="never")  # the cell itself compares with one process
    ids, kwargs, samples = batch(family, kind)
    if not _runs(family):
        kwargs.pop("mm_token_type_ids")
        labels, positions = cptune.shift_labels(ids), torch.arange(ids.shape[1]).view(1, -1)
        try:
            with cptune.context_parallel(buffers={"input_ids": ids, "labels": labels, "position_ids": positions},
                                         seq_dims={"input_ids": 1, "labels": 1, "position_ids": 1}):
                model(input_ids=ids, position_ids=positions, shift_labels=labels, use_cache=False,
                      **{k: v.to("meta") if k.startswith("pixel") else v for k, v in kwargs.items()})
        except cptune.CPTuneError as exc:
            return _refused(exc)
        return {"status": "error", "message": "a family cptune does not split ran under CP"}
    reference = build(family)
    types = kwargs.pop("mm_token_type_ids")
    positions = cptune.hf.position_ids(reference, ids, documents=samples, image_grid_thw=kwargs.get("image_grid_thw"),
                                       video_grid_thw=kwargs.get("video_grid_thw"), mm_token_type_ids=types)
    labels = ids.clone()
    labels[ids >= TOKENS["image_token_id"]] = -100  # placeholders and vision marks carry no loss
    shifted = cptune.shift_labels(labels)
    if samples is not None:  # no label across a sample's end
        shifted[:, :-1][samples[:, 1:] != samples[:, :-1]] = -100
    try:
        want = reference(input_ids=ids, position_ids=positions, labels=shifted, shift_labels=shifted,
                         use_cache=False, **kwargs).loss
        want.backward()
    except Exception as exc:  # noqa: BLE001 - transformers alone cannot run it: nothing to be exact to
        return {"status": "no reference", "message": f"{type(exc).__name__}: {exc}"[:300]}
    config = cptune.CPConfig(strategy=strategy, load_balance=load_balance,
                             **({"ulysses_degree": 2} if strategy == "hybrid" else {}))
    try:
        with cptune.context_parallel(buffers={"input_ids": ids, "labels": shifted, "position_ids": positions},
                                     seq_dims={"input_ids": 1, "labels": 1, "position_ids": 2}, config=config):
            loss = model(input_ids=ids, position_ids=positions, shift_labels=shifted, use_cache=False, **kwargs).loss
            loss.backward()
    except cptune.CPTuneError as exc:
        return _refused(exc)
    loss = loss.detach()
    dist.all_reduce(loss)
    errors = {}
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad)
        errors[name] = _relative(grad / world, r.grad if r.grad is not None else torch.zeros_like(p))
    loss_err = abs(loss.item() / world - want.item())
    worst = max(errors, key=errors.get)
    exact = loss_err <= LOSS_TOL and errors[worst] <= GRAD_TOL
    return {"status": "exact" if exact else "wrong", "loss_err": loss_err, "grad_err": errors[worst], "worst": worst}


def _cells(names: list[str], cells: dict) -> dict[str, dict[str, dict]]:
    return {family: {label: _caught(_cell, family, *cells[label][:3]) for label in cells} for family in names}


def run(group2, group4=None, names: list[str] | None = None) -> dict[str, dict[str, dict]]:
    """The rows over ``names`` (default: every family this transformers has): rank 0's cells, every rank agreeing."""
    names = families() if names is None else names
    two = {label: cell for label, cell in CELLS.items() if cell[3] == 2}
    matrix = _agreed(group2.run(_cells, names, two))
    if group4 is not None:
        four = {label: cell for label, cell in CELLS.items() if cell[3] == 4}
        for family, cells in _agreed(group4.run(_cells, names, four)).items():
            matrix[family].update(cells)
    return matrix


def main(argv: list[str]) -> int:
    import transformers

    from cptune.launch import WorkerGroup

    from .matrix_docs import table, update_docs

    groups = WorkerGroup(2), WorkerGroup(4)
    try:
        matrix = run(*groups)
    finally:
        for g in groups:
            g.close()
    text = table(matrix, transformers.__version__, list(CELLS), "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES")
    print(text)
    if "--update-docs" in argv:
        update_docs(text, transformers.__version__, "matrix_vision")
        write_proven(matrix, transformers.__version__, "matrix_vision", proven_names(matrix))
    return 0


def proven_names(matrix: dict[str, dict[str, dict]]) -> list[str]:
    """The families exact in every cell, and their language models' own model types (their text-only calls need no
    first-step check either): what ``cptune.hf`` takes as proven for images and video."""
    names = proven(matrix, CELLS)
    texts = [getattr(tiny_config(f).get_text_config(), "model_type", f) for f in names]
    return sorted({*names, *texts})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
