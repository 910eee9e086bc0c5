"""cptune plan reads a mixture of experts and multi-head latent attention from a config's fields: total parameters for
memory, active ones for FLOPs, against published counts and against what transformers builds; planned without
allocating the model, and without transformers installed."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cptune
import cptune.plan as P
from cptune.plan._calibrate import Calibration
from cptune.plan._dims import _from_fields

ROOT = Path(__file__).resolve().parents[1]
QWEN3_MOE = ROOT / "examples/models/qwen3-30b-a3b"
DEEPSEEK_V3 = ROOT / "examples/models/deepseek-v3"
GPT_OSS_120B = ROOT / "examples/models/gpt-oss-120b"
LLAMA_8B = ROOT / "examples/models/llama-3.1-8b"
H100 = P.load_hardware("h100")

WITHOUT_TRANSFORMERS = "import sys; sys.modules['transformers'] = None\n"
"""Put first in a ``python -c`` script: ``import transformers`` then raises ImportError, as where it is not
installed."""


def _near(value: float, published: float) -> bool:
    return abs(value / published - 1) <= 0.02


def test_published_moe_models_count_their_published_parameters():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B activated (Qwen's model card). DeepSeek-V3: 671B, 37B activated (DeepSeek's
    technical report); the Hugging Face checkpoint's 685B also holds the 14B multi-token-prediction module
    (num_nextn_predict_layers), which transformers does not build, so training through it does not hold it either."""
    qwen, deepseek = P.dims_from_config(QWEN3_MOE), P.dims_from_config(DEEPSEEK_V3)
    assert _near(qwen.params, 30.5e9) and _near(qwen.active_params, 3.3e9), (qwen.params, qwen.active_params)
    assert _near(deepseek.params, 671e9) and _near(deepseek.active_params, 37e9), \
        (deepseek.params, deepseek.active_params)
    moe = qwen.experts
    assert (moe.experts, moe.active, moe.width, moe.layers, moe.shared_width) == (128, 8, 768, 48, 0)
    assert "30.53B parameters (3.35B active: 8 of 128 experts)" in qwen.describe(), qwen.describe()
    moe, mla = deepseek.experts, deepseek.latent
    assert (moe.experts, moe.active, moe.width, moe.layers, moe.shared, moe.shared_width) == (256, 8, 2048, 58, 1, 2048)
    assert (mla.q_rank, mla.kv_rank, mla.nope, mla.rope, mla.v_head_dim) == (1536, 512, 128, 64, 128)
    assert (deepseek.head_dim, deepseek.value_dim, deepseek.kv_heads) == (192, 128, 128)  # every head's K and V
    assert "671.03B parameters (37.55B active: 8 of 256 experts + 1 shared)" in deepseek.describe()
    for folder in (QWEN3_MOE, DEEPSEEK_V3):  # the JSON alone reads the same as transformers' config
        raw = json.loads((folder / "config.json").read_text())
        assert _from_fields(raw, folder.name) == P.dims_from_config(folder)


def test_the_example_configs_load_in_transformers():
    transformers = pytest.importorskip("transformers")
    qwen = transformers.AutoConfig.from_pretrained(QWEN3_MOE)
    deepseek = transformers.AutoConfig.from_pretrained(DEEPSEEK_V3)
    assert (type(qwen).__name__, qwen.num_experts, qwen.moe_intermediate_size) == ("Qwen3MoeConfig", 128, 768)
    assert (type(deepseek).__name__, deepseek.n_routed_experts, deepseek.kv_lora_rank) == ("DeepseekV3Config", 256, 512)


# -- every family's count against the model transformers builds --------------------------------------------------

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
TINY_MOE = {"num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8,
            "moe_intermediate_size": 32, "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2,
            "shared_expert_intermediate_size": 48, "shared_intermediate_size": 40, "n_shared_experts": 1,
            "num_shared_experts": 1, "first_k_dense_replace": 1, "num_dense_layers": 1, "n_group": 1, "topk_group": 1,
            "mlp_only_layers": [2], "decoder_sparse_step": 1, "interleave_moe_layer_step": 2,
            "intermediate_size_mlp": 96, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8, "v_head_dim": 12}
"""Fields a tiny config takes where its family has them (its class's own fields only, as its config.json would):
dense layers beside MoE ones, shared experts, MLA, by each family's rule."""
EXACT = ["llama", "qwen3", "mistral", "qwen2", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3",
         "deepseek_v2", "glm4_moe", "glm4_moe_lite", "gpt_oss", "granitemoe", "granitemoeshared", "dots1", "exaone_moe",
         "solar_open", "flex_olmo", "llama4_text", "minimax_m2", "ernie4_5_moe", "hunyuan_v1_moe", "sarvam_moe"]
NEAR = {"phimoe": "its norms are LayerNorms with biases (2 x hidden a norm, not hidden)",
        "cohere2_moe": "one norm a layer (attention and MLP in parallel), not two",
        "qwen3_next": "its q_proj also makes the attention's output gate (the hybrid's attention layers)"}
"""Families read within NEAR_TOLERANCE, and what the reading leaves out: norms and gates, no more."""
NEAR_TOLERANCE = 2e-3


def _tiny(family: str):
    transformers = pytest.importorskip("transformers")
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {family}")
    cls = transformers.CONFIG_MAPPING[family]
    declared = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else \
        set(inspect.signature(cls.__init__).parameters)  # transformers 4.x: its config's own arguments
    config = cls(**TINY, **{k: v for k, v in TINY_MOE.items() if k in declared})
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _routed(name: str) -> bool:
    """A routed expert's tensor (every family keeps them under ``experts.``, shared ones under ``shared_*``; GraniteMoE
    on transformers 4.x keeps them as its MoE block's ``input_linear`` and ``output_linear``)."""
    return re.search(r"(?<!shared_)experts\.|block_sparse_moe\.(input|output)_linear\.", name) is not None


@pytest.mark.parametrize("family", EXACT + list(NEAR))
def test_the_field_reading_counts_what_transformers_builds(family):
    """A tiny config of each family: the parameters read from its fields equal the sum of numel of the model
    transformers builds on the meta device; the active ones equal that sum with each MoE layer's routed experts
    counted top-k of n (the built model's expert tensors, scaled), so FLOPs count what a token goes through."""
    import torch
    import transformers

    config = _tiny(family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    dims = _from_fields(config.to_dict(), family)
    if family in NEAR:
        assert abs(dims.params / built - 1) <= NEAR_TOLERANCE, (family, dims.params, built)
        return
    assert dims.params == built, (family, dims.params, built)
    routed = {n: p for n, p in model.named_parameters() if _routed(n)}
    if dims.experts is None:
        assert not routed and dims.active_params == dims.params
        return
    n, k = dims.experts.experts, dims.experts.active
    grouped = all(p.shape[0] == n for p in routed.values())  # transformers 5: one tensor of every expert
    each = {re.search(r"experts\.(\d+)\.", name).group(1) for name in routed} if not grouped else set()
    assert routed and (grouped or len(each) == n), (family, n, sorted(each))  # 4.x: a module per expert
    moe_layers = {re.search(r"layers\.(\d+)\.", name).group(1) for name in routed}
    assert dims.experts.layers == len(moe_layers), (family, dims.experts.layers, sorted(moe_layers))  # the layer rule
    assert dims.active_params == built - sum(p.numel() for p in routed.values()) * (n - k) // n, family


# -- the plan of an MoE ----------------------------------------------------------------------------------------------

def test_memory_holds_every_expert_and_flops_count_the_active_ones():
    """An MoE's parameters, gradients and optimizer state are its total's; an MoE layer's FSDP unit gathers every
    expert; its FLOPs are its active parameters' (a dense model of its total size costs more per token)."""
    dims = P.dims_from_config(QWEN3_MOE)
    work = P.plan_workload(dims, 32768)
    point = P.Point(cptune.CPConfig(mesh_shape=(1, 8), rotate_method="alltoall", load_balance=True), "full")
    moe = P.predict(dims, work, point, H100, 8)
    assert moe.memory["parameters"] == 4 * dims.params // 8 and moe.memory["optimizer"] == 8 * dims.params // 8
    unit = dims.layer_params - 3 * dims.hidden * dims.ffn + dims.experts.params  # every layer is MoE: the mean too
    assert dims.unit_params == unit == dims.all_layer_params / dims.layers
    assert moe.memory["gathered_layers"] == int((2 * unit + dims.vocab * dims.hidden) * 2)
    deepseek = P.dims_from_config(DEEPSEEK_V3)  # 3 dense layers: the unit gathered is an MoE layer's, the largest
    moe_layer = deepseek.layer_params - 3 * deepseek.hidden * deepseek.ffn + deepseek.experts.params
    assert deepseek.unit_params == moe_layer > deepseek.all_layer_params / deepseek.layers
    dense = dims.model_copy(update={"experts": None, "ffn": dims.experts.experts * dims.experts.width})
    assert dense.params == pytest.approx(dims.params, rel=0.01)
    as_dense = P.predict(dense, work, point, H100, 8)
    assert as_dense.memory["parameters"] == pytest.approx(moe.memory["parameters"], rel=0.01)

    def flops(d):  # the matmuls of a forward a token, as the step model counts them (the head's over the vocabulary)
        return d.layers * (d.active_layer_params / d.layers - 2 * d.hidden) + d.hidden * d.vocab

    assert moe.time["dense"] == pytest.approx(as_dense.time["dense"] * flops(dims) / flops(dense), rel=1e-6)
    assert flops(dims) < 0.15 * flops(dense)


def test_mla_attention_is_priced_by_its_head_dims():
    """MLA's q and k heads are nope + rope wide and its v heads v_head_dim: attention's FLOPs are 2 (dqk + dv) a pair
    and head, not 4 dqk."""
    dims = P.dims_from_config(DEEPSEEK_V3)
    work = P.plan_workload(dims, 65536)
    point = P.Point(cptune.CPConfig(mesh_shape=(1, 64), rotate_method="alltoall", load_balance=True), "full")
    mla = P.predict(dims, work, point, H100, 8)
    square = P.predict(dims.model_copy(update={"v_head_dim": 0}), work, point, H100, 8)
    assert mla.time["attention"] == pytest.approx(square.time["attention"] * (192 + 128) / (2 * 192), rel=1e-9)
    assert mla.time["comm_ring"] < square.time["comm_ring"]  # V blocks are 128 wide, not 192


def _plans():
    qwen, deepseek, llama = (P.dims_from_config(m) for m in (QWEN3_MOE, DEEPSEEK_V3, LLAMA_8B))
    yield P.plan(qwen, P.plan_workload(qwen, 131072, model=str(QWEN3_MOE)), H100, 16)
    yield P.plan(deepseek, P.plan_workload(deepseek, 131072, model=str(DEEPSEEK_V3)), H100, 64, ac_modes=("full",))
    yield P.plan(llama, P.plan_workload(llama, 131072), H100, 16, budget=60 * 2**30, ac_modes=("selective", "full"))
    for memory in (0.5, 1.5):  # calibrated: the parts scale with the peak, and the rule holds all the same
        yield P.plan(qwen, P.plan_workload(qwen, 131072), H100, 16, ac_modes=("full",),
                     calibration=Calibration(memory=memory, trials=3, fitted=("memory",)))


def test_no_row_is_feasible_whose_memory_parts_exceed_the_budget():
    """Over every prediction of a few plans (MoE, MLA, dense, calibrated above and below 1): a row's peak is its
    memory parts summed, and it is called feasible exactly when that sum fits the budget."""
    rows = fitting = 0
    for plan in _plans():
        assert plan.predictions and any(p.infeasible for p in plan.predictions)
        for p in plan.predictions:
            rows, fitting = rows + 1, fitting + (p.infeasible is None)
            assert p.peak_bytes == sum(p.memory.values()), p.point.label()
            assert (p.infeasible is None) == (sum(p.memory.values()) <= plan.budget), (p.point.label(), p.infeasible)
            assert p.infeasible is None or (p.bottleneck.startswith("memory") and "budget" in p.infeasible)
    assert rows > 100 and fitting > 10, (rows, fitting)


def test_a_deepseek_v3_fits_nothing_without_expert_parallelism_and_says_each_part():
    dims = P.dims_from_config(DEEPSEEK_V3)
    plan = P.plan(dims, P.plan_workload(dims, 131072, model=str(DEEPSEEK_V3)), H100, 64, ac_modes=("full",))
    assert plan.best is None
    said = plan.shortfall()
    for part in ("parameters", "gradients", "optimizer", "gathered_layers", "activations", "loss", "attention_buffers",
                 "baseline"):
        assert re.search(rf"{part} \d+\.\d\dGiB", said), (part, said)
    assert "58 of the 61 layers are a mixture of experts (8 of 256 experts + 1 shared)" in plan.header()
    assert {p.point.config.parallel_dims().tp for p in plan.predictions} == {1}  # experts are not split by tp
    by_hand = P.plan(dims, P.plan_workload(dims, 131072), H100, 64, ac_modes=("full",))  # no model to read a TP plan
    assert {p.point.config.parallel_dims().tp for p in by_hand.predictions} == {1}


def test_expert_parallelism_fits_a_deepseek_v3_on_256_h100s_where_fsdp2_alone_does_not():
    """At 128K tokens on 256 H100s the plan proposes an ep configuration that fits: its gathered layers are an MoE
    layer's E / ep experts, not all 256; every row without ep is over the budget, by its gathered layers."""
    dims = P.dims_from_config(DEEPSEEK_V3)
    plan = P.plan(dims, P.plan_workload(dims, 131072, model=str(DEEPSEEK_V3)), H100, 256, ac_modes=("full",))
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:  # 4.x builds a list of expert modules: no ep to offer
        assert {p.point.config.ep_degree for p in plan.predictions} == {1} and plan.best is None
        assert "(no ep: transformers builds these experts ungrouped, or is missing)" in plan.header()
        return
    best = plan.best
    assert best is not None and best.point.config.ep_degree > 1 and best.peak_bytes <= plan.budget, plan.table(5)
    assert best.time["comm_ep"] > 0 and f"ep{best.point.config.ep_degree}" in plan.best_line()
    alone = [p for p in plan.predictions if p.point.config.ep_degree == 1]
    assert alone and all(p.infeasible for p in alone)
    closest = min(alone, key=lambda p: p.peak_bytes)
    assert closest.memory["gathered_layers"] > 4 * best.memory["gathered_layers"], (closest.memory, best.memory)
    assert "or E / ep under expert parallelism" in plan.header()
    assert {p.point.ac for p in plan.predictions} == {"full"}
    selective = P.plan(dims, P.plan_workload(dims, 131072, model=str(DEEPSEEK_V3)), H100, 256,
                       ac_modes=("selective",))
    assert {p.point.config.ep_degree for p in selective.predictions} == {1}  # refused with ep under FSDP2


def test_gpt_oss_120b_counts_its_published_parameters():
    """OpenAI's model card: 116.8B parameters, 5.1B active (the embedding table not counted: 5.71B less its 0.58B)."""
    dims = P.dims_from_config(GPT_OSS_120B)
    assert abs(dims.params / 116.8e9 - 1) < 0.002, dims.params
    assert abs((dims.active_params - dims.vocab * dims.hidden) / 5.13e9 - 1) < 0.01, dims.active_params
    assert "4 of 128 experts" in dims.describe()


def test_planning_a_deepseek_v3_allocates_nothing_and_takes_seconds():
    """The plan builds a model only to read its family's rules, on the meta device, every tensor there: a DeepSeek-V3
    (whose experts transformers allocates whole) is planned in a process that stays far under 2 GiB."""
    script = f"""
import resource, sys
from cptune.cli import main
sys.argv = ["cptune", "plan", "--model", {str(DEEPSEEK_V3)!r}, "--seq-len", "131072", "--gpus", "64", "--json"]
try:
    main()
except SystemExit as exc:
    print("peak KiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
    raise
"""
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["best"] is None and plan["model"]["experts"]["experts"] == 256 and plan["predictions"]
    peak_kib = int(re.search(r"peak KiB (\d+)", run.stderr).group(1))
    assert peak_kib * 1024 < 2**30, peak_kib  # the model's parameters alone would be 2.5 TiB in float32
    assert elapsed < 60, elapsed


def test_the_plan_reads_a_model_without_transformers():
    """With transformers hidden (``import transformers`` raises ImportError): the README's quick-start line, and both
    MoE examples, planned from their config.json's fields, saying so in the header; tp = 1 only."""
    script = WITHOUT_TRANSFORMERS + """
from click.testing import CliRunner
from cptune.cli import main
try:
    import transformers
except ImportError:
    print("hidden")
for model, gpus in (("examples/models/llama-3.1-8b", "64"), ("examples/models/qwen3-30b-a3b", "8"),
                    ("examples/models/deepseek-v3", "64")):
    result = CliRunner().invoke(main, ["plan", "--model", model, "--seq-len", "131072", "--gpus", gpus, "--hardware",
                                       "h100", "--all"])
    print("exit", result.exit_code)
    print(result.output)
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith("hidden\n") and out.count("exit 0") == 3, out[-2000:]
    assert out.count("note: transformers is not installed: planned from config.json's fields alone") == 3
    assert "llama-3.1-8b: 8.03B parameters" in out and "best (predicted): dp" in out
    assert "30.53B parameters (3.35B active: 8 of 128 experts)" in out
    assert "671.03B parameters (37.55B active: 8 of 256 experts + 1 shared)" in out
    assert "nothing is predicted to fit" in out
    assert not re.search(r"·tp\d", out)  # no tp row: the family's TP plan is not read


def test_a_failed_meta_build_never_names_the_installed_release(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from cptune import models
    from cptune._deps import version_tuple

    def refuse(*args, **kwargs):
        raise RuntimeError("cannot allocate")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    with pytest.raises(cptune.ValidationError) as caught:
        models.empty_model(models.load_config(QWEN3_MOE), structure_only=True)
    fix = caught.value.problems[0].fix
    if version_tuple(transformers.__version__) >= (5, 25, 0):
        assert "pip install -U transformers" not in fix and "plans it from the config's fields" in fix, fix
    else:
        assert "pip install -U transformers" in fix
