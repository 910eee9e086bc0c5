"""The support matrix (benchmarks/matrix.py) in CI: every family of this transformers, a tiny config from its own
config class, under the ring and Ulysses (unpadded and packed) on 2 ranks and tp2·cp2 on 4; each cell exact or
refused by name, the table in docs/transformers.md what the run printed. The layer rule (cptune/mixers/_rule.py) names
every layer that mixes tokens outside attention in every entry point, before any rank or collective."""

import sys

import pytest
import torch.nn as nn

import cptune
from benchmarks import matrix as M
from cptune import models
from cptune.mixers import _choice as _paths
from cptune.mixers import _rule as _mixers
from tests import _warm as warm

transformers = pytest.importorskip("transformers")

HYBRIDS = {"qwen3_next": ["heads"], "qwen3_5_text": ["heads"], "lfm2": ["halo"], "bamba": ["heads"],
           "falcon_h1": ["generic"], "jamba": ["generic"], "granitemoehybrid": ["heads"], "minimax": ["generic"],
           "zamba2": ["generic", "heads"]}
"""Each hybrid family and the paths its mixers take (cptune.mixers._choice): Gated DeltaNet and Bamba-form Mamba2 split over
heads, LFM2's short convolutions by a halo exchange, Falcon-H1's scaled Mamba2, Jamba's Mamba and MiniMax's
lightning attention by the generic path; Zamba2's Mamba layers by heads, the Mamba layer inside each of its hybrid
layers (fed the shared transformer's output, which trains through it) by the generic path."""
SILENTLY_WRONG_BEFORE = ("llama4_text", "zamba2")
"""Trained silently wrong before cptune made them exact: Llama 4's chunked attention and NoPE temperature, Zamba2's
shared block (no gradient through the generic path)."""
INDEXERS = ("deepseek_v32", "glm_moe_dsa", "qwen4_exp_text")
"""Sparse attention (DSA, QSA) that scores keys outside SDPA: refused by name (a traceback from transformers
before)."""


def test_every_cell_is_exact_or_refused_by_name_and_the_docs_hold_the_table(ranks):
    matrix = M.run(ranks(2), ranks(4))
    floor = transformers.__version__.startswith("4.")
    assert len(matrix) >= (30 if not floor else 25), sorted(matrix)
    bad = {(f, c): cell for f, cells in matrix.items() for c, cell in cells.items()
           if cell["status"] not in M.ACCEPTED}
    assert not bad, bad
    for family in HYBRIDS:  # silently wrong before, then refused: exact by the generic path now
        for label in M.CP_CELLS if family in matrix else ():
            cell = matrix[family][label]
            # on 4.56: Bamba and Granite 4 cannot be built on the meta device, Falcon-H1 calls SDPA with its own mask,
            # and Jamba trains only with CUDA kernels (one process fails too): each said by name
            assert cell["status"] == "exact" or floor and cell["status"] in ("refused", "no reference"), \
                (family, label, cell)
            assert cell["status"] != "exact" or cell["paths"] == HYBRIDS[family], (family, label, cell)
    for family in SILENTLY_WRONG_BEFORE:  # on 4.56 Llama 4's MoE mixes tokens (the check refuses it), and Zamba2
        # builds its own mask for a shard (refused by name)
        refused = ("refused: first-step check", "refused: attention_mask") if floor else ()
        assert all(matrix[family][c]["status"] == "exact" or M.short(matrix[family][c]) in refused
                   for c in M.CP_CELLS), (family, matrix[family])
    for family in [f for f in INDEXERS if f in matrix]:  # newer than 4.56
        assert all(M.short(matrix[family][c]) == "refused: sparse-attention indexer" for c in M.CP_CELLS), \
            (family, matrix[family])
    for family in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "mixtral", "deepseek_v3", "olmo3", "olmoe",
                   "apertus", "gpt_oss"):  # GPT-OSS: its attention sinks, sliding windows and experts
        if family in matrix:  # OLMo3 is newer than 4.56
            assert all(matrix[family][c]["status"] == "exact" for c in M.CP_CELLS), (family, matrix[family])
    assert all(M.short(matrix["gemma2"][c]) == "refused: attention softcapping" for c in M.CP_CELLS), matrix["gemma2"]
    for family in ("llama", "qwen3", "gemma3_text", "olmo2", "exaone4", "apertus"):  # q/k norms: replicated over tp
        assert matrix[family][M.TP_CELL]["status"] == "exact", (family, matrix[family][M.TP_CELL])
    documented = M.documented(transformers.__version__)
    assert documented is not None or floor, "run python -m benchmarks.matrix --update-docs"
    if documented is not None and f"transformers {transformers.__version__})" in documented.splitlines()[0]:
        assert documented == M.table(matrix, transformers.__version__), "run python -m benchmarks.matrix --update-docs"
        # the first-step check skips what this run proved, and checks everything else
        from cptune.hf._check import proven_families

        major = transformers.__version__.split(".", 1)[0]
        assert list(proven_families()[major]) == M.proven(matrix), "run python -m benchmarks.matrix --update-docs"


def _meta(family):
    return models.empty_model(M.tiny_config(family))


@pytest.mark.parametrize("family,named,block", [
    ("qwen3_next", "linear_attn.conv1d", "linear_attn"), ("lfm2", "conv.conv", "conv"),
    ("bamba", "mamba.conv1d", "mamba"), ("minimax", "'linear_attention'", "self_attn")])
def test_the_rule_names_each_layer_that_mixes_tokens_and_a_path_covers_it(family, named, block):
    if M.tiny_config(family) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    try:
        model = _meta(family)
    except cptune.ValidationError as exc:  # Bamba on 4.56: refused by name, before the layer rule can look
        assert "cannot build it on the meta device" in str(exc) and transformers.__version__.startswith("4."), exc
        pytest.skip(str(exc))
    problems = _mixers.cp_problems(family, _mixers.model_mixers(model), 2, "cp")
    assert len(problems) == 1 and named in problems[0].message and "Fix:" in str(problems[0]), problems
    covered, left = _mixers.model_coverage(model)
    assert covered and all(path.endswith(f".{block}") for path in covered) and left == [], (covered, left)
    assert models.cp_problems(M.tiny_config(family), 2) == []  # exact by the generic path: nothing to refuse
    split = {path for path, module in covered.items() if _paths.splits(module)}  # LFM2's (halo), GDN's, Mamba2's
    assert (split == set(covered)) == (family != "minimax"), split  # MiniMax's lightning attention: generic
    assert set(models.whole_layers(M.tiny_config(family), model)) == set(covered) - split
    assert set(models.whole_layers(M.tiny_config(family), model, mixers="whole")) == set(covered)


class _Shift(nn.Module):  # a family cptune has never seen: a token shift it has no rule for
    def forward(self, x):
        return nn.functional.pad(x, (0, 0, 1, -1))


def test_a_module_no_rule_knows_is_named_not_waved_through_and_can_be_vouched_for():
    model = _meta("llama")
    model.model.layers[1].mlp.shift = _Shift()
    found = _mixers.model_mixers(model)
    assert [m.path for m in found] == ["model.layers.1.mlp.shift"] and "cannot tell" in found[0].why, found
    assert _mixers.model_mixers(model, token_wise=[_Shift]) == []
    model.model.layers[0].mlp.conv = nn.Conv1d(4, 4, 1)  # a kernel of one position is per-token
    model.model.layers[0].mlp.gru = nn.GRU(4, 4)
    assert [m.kind for m in _mixers.model_mixers(model, ["_Shift"])] == ["GRU"]


def _shifted():
    import cptune.hf

    model = models.build_model(M.tiny_config("llama"), "cpu")
    model.model.layers[1].mlp.shift = _Shift()
    return cptune.hf.enable(model)


def _refused_in_block():
    model = _shifted()
    ids, labels, positions = M._batch(False)
    try:
        with cptune.context_parallel(buffers=[ids, positions], seq_dims=[1, 1]):
            model(input_ids=ids, position_ids=positions)
    except cptune.ValidationError as exc:
        return str(exc)
    return "ran"


def test_what_no_path_covers_is_refused_at_its_first_forward_in_a_block_and_by_prepare_for_training(ranks):
    for message in ranks(2).run(_refused_in_block):
        assert "model: is cp=2 but LlamaForCausalLM mixes tokens outside attention" in message \
            and "layer 1 mlp.shift (a _Shift" in message, message
    with pytest.raises(cptune.ValidationError, match="cp: is cp=2 but LlamaForCausalLM mixes tokens"):
        models.prepare_for_training(_shifted(), cp=2)


def test_the_plan_says_what_runs_whole_and_proposes_no_tp_a_family_cannot_take(tmp_path):
    from cptune.plan import dims_from_config, load_hardware, plan

    for family in [f for f in ("qwen3_next", "qwen3", "qwen3_moe", "lfm2") if M.tiny_config(f) is not None]:
        M.tiny_config(family).save_pretrained(tmp_path / family)
        path = str(tmp_path / family)
        result = plan(dims_from_config(path), cptune.Workload(seq_len=8192, model=path, heads=4, kv_heads=2,
                                                                   head_dim=16, layers=4 if family == "qwen3_next" else 2),
                           load_hardware("h100"), 16)
        shapes = [p.point.config.parallel_dims() for p in result.predictions]
        config = M.tiny_config(family)
        made = models.empty_model(config)  # built once: each call would build it again (40 ms, thousands of rows)
        problems = [models.mesh_problems(config, d, model=made) for d in shapes]
        assert shapes and not any(problems), (family, problems[:1])
        if family == "qwen3_next":  # its Gated DeltaNet priced on its path: split by heads, or whole (both rows)
            assert "3 of the 4 layers are gated_deltanet: priced on their path" in result.header(), result.header()
            assert {p.point.config.mixers for p in result.predictions if p.point.config.parallel_dims().cp > 1} \
                == {"split", "whole"}
        if family == "lfm2":  # its short convolutions split over cp (the halo path): nothing runs whole
            assert "run whole" not in result.header() and any(d.cp > 1 for d in shapes), result.header()
        assert any(d.tp > 1 for d in shapes) == (family == "qwen3"), (family, shapes)  # q/k norms split; MoE not


def test_launch_names_a_bad_tp_override_once_before_any_rank_starts(tmp_path):
    from tests._helpers import write_recipe

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=256)
    config.save_pretrained(tmp_path / "m6")
    workload = cptune.Workload(seq_len=64, batch=2, model=str(tmp_path / "m6"), heads=6, kv_heads=6, head_dim=16,
                               layers=2)
    recipe = write_recipe(tmp_path / "r.yaml", workload, cptune.CPConfig(mesh_shape=(1, 4)),
                          script="cptune.examples.train_hf")
    run = warm.run([sys.executable, "-m", "cptune", "launch", str(recipe), "config.mesh_shape=[1,1,1,4]", "--",
                    "--steps", "1"], tmp_path, 300)
    assert run.returncode == 1, run.stderr
    assert run.stderr.count("4 does not divide the 6 query heads") == 1, run.stderr
    assert "Traceback" not in run.stderr and "ChildFailedError" not in run.stderr and "torch.distributed" not in \
        run.stderr, run.stderr
    # tp 2 leaves 3 heads a rank, which 2 Ulysses ranks do not split: one message too, before torchrun
    run = warm.run([sys.executable, "-m", "cptune", "launch", str(recipe), "config.mesh_shape=[1,1,2,2]",
                    "config.strategy=ulysses", "--", "--steps", "1"], tmp_path, 300)
    assert run.returncode == 1 and run.stderr.count("2 Ulysses ranks do not divide the 3 query heads") == 1, \
        run.stderr
    assert "Traceback" not in run.stderr and "ChildFailedError" not in run.stderr, run.stderr
