"""The first-step check (cptune/_check.py, _hf_check.py, _check_step.py): a family the support matrix has not proven
is run as one process and split over cp on the user's own ranks before it trains; each way a family has trained
silently wrong or crashed inside transformers is refused by name at the first step, before the optimizer steps."""

import pytest
import torch

import cptune
from benchmarks import matrix as M
from tests._broken import BROKEN, broken
from cptune import verify as _check

transformers = pytest.importorskip("transformers")
UNPROVEN = "helium"  # a Llama-like family the matrix does not run: the check runs for it, and passes


def _tiny(family: str):
    """The matrix's tiny config of ``family``, or one from the matrix's base fields for a family it does not run."""
    if family in M.FAMILIES:
        return M.tiny_config(family)
    config = transformers.CONFIG_MAPPING[family](**M.BASE)
    config.use_cache = False
    return config


def _first_step(family: str, how: str, packed: bool, vouch: tuple = ()):
    """One training step of ``family`` on this group's ranks, enabled with check='always' and broken ``how``: the
    refusal's text, and whether the parameters and the optimizer are as before."""
    import cptune.hf
    from cptune import models

    with broken(how):
        model = models.build_model(_tiny(family), "cpu")
        cptune.hf.enable(model, check="always", token_wise=vouch)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        ids, labels, positions = M._batch(packed)
        shifted = cptune.shift_labels(labels)
        buffers = {"input_ids": ids, "shift_labels": shifted, "position_ids": positions}
        try:
            with cptune.context_parallel(buffers=buffers, seq_dims=dict.fromkeys(buffers, 1)):
                cptune.hf.causal_lm_loss(model, ids, shifted, position_ids=positions).backward()
            optimizer.step()
            message = "trained"
        except cptune.ValidationError as exc:
            message = str(exc)
        untouched = all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and not optimizer.state
        return message, untouched


@pytest.mark.parametrize("family,named", [
    ("llama4_text", "differs from one process in the output of model.layers."),
    ("zamba2", "the gradient of model.layers."),
    ("deepseek_v32", "raised TypeError"),
    ("qwen4_exp_text", "raised AttributeError"),
])
def test_each_way_a_family_failed_is_refused_by_the_check_before_the_optimizer_steps(ranks, family, named):
    """Llama 4 read its shard's positions (chunks, NoPE temperature), Zamba2's shared block got no gradient, the DSA
    and QSA indexers crashed inside transformers: with cptune's fix for each undone (the indexers vouched for, so the
    rule that names them lets them through), the first-step check is what refuses them, by name."""
    if M.tiny_config(family) is None or transformers.__version__.startswith("4.") and family == "zamba2":
        pytest.skip(f"transformers {transformers.__version__} has no {family}, or refuses its own mask first")
    how, vouch = BROKEN[family]
    for packed in (False, True):
        for message, untouched in ranks(2).run(_first_step, family, how, packed, vouch):
            assert "fails cptune's first-step check" in message and named in message, message
            assert ("packed" in message) == packed or "raised" in message, message
            assert "Fix: train this model with cp=1" in message and untouched, message


def _modes(family: str, mode: str | None, vouch: tuple = ()) -> list[str]:
    import cptune.hf
    from cptune import models

    model = models.build_model(_tiny(family), "cpu")
    cptune.hf.enable(model, token_wise=vouch, **({"check": mode} if mode else {}))
    ids, labels, positions = M._batch(True)
    shifted = cptune.shift_labels(labels)
    buffers = {"input_ids": ids, "shift_labels": shifted, "position_ids": positions}
    for strategy in ("ring", "ring", "ulysses"):  # once per configuration: ring, then ulysses
        with cptune.context_parallel(buffers=buffers, seq_dims=dict.fromkeys(buffers, 1),
                                     config=cptune.CPConfig(strategy=strategy)):
            cptune.hf.causal_lm_loss(model, ids, shifted, position_ids=positions).backward()
    return [report.line() for report in getattr(model, "_cptune_checks", {}).values()]


def test_a_proven_family_skips_the_check_an_unproven_one_runs_it_once_per_configuration(ranks):
    group = ranks(2)
    assert group.run(_modes, "llama", None)[0] == []  # proven by the matrix
    assert group.run(_modes, "llama", "never", ("LlamaMLP",))[0] == []
    vouched = group.run(_modes, "llama", None, ("LlamaMLP",))[0]  # a module vouched for: unproven
    lines = group.run(_modes, UNPROVEN, None)[0]
    assert len(lines) == 2 and len(vouched) == 2, (lines, vouched)
    assert "ulysses" not in lines[0] and "ulysses" in lines[1], lines
    assert all(": exact;" in x and "packed" in x for x in lines), lines
    assert len(group.run(_modes, "llama", "always")[0]) == 2


def _up_front_under_fsdp(strategy: str):
    """cptune.hf.check before the first step on an FSDP2 model, then two steps: the losses of a model never checked,
    and the block checks nothing again."""
    import torch.distributed as dist

    import cptune.hf
    from cptune import models
    from cptune.mesh import world_mesh

    losses, lines = {}, []
    config = cptune.CPConfig(strategy=strategy)
    for mode in ("always", "never"):
        model = models.build_model(_tiny(UNPROVEN), "cpu", fsdp_mesh=world_mesh("cpu"), ac="full")
        cptune.hf.enable(model, check=mode)
        report = cptune.hf.check(model, config=config)
        lines.append(report.line() if report is not None else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids, labels, positions = M._batch(False)
        shifted = cptune.shift_labels(labels)
        losses[mode] = []
        for _ in range(2):
            with cptune.context_parallel(buffers=[ids, shifted, positions], seq_dims=[1, 1, 1], config=config):
                loss = cptune.hf.causal_lm_loss(model, ids, shifted, position_ids=positions)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss = loss.detach()
            dist.all_reduce(loss)
            losses[mode].append(loss.item())
        losses[mode + " checks"] = len(model._cptune_checks) if report is not None else 0
    assert lines[1] is None  # check='never'
    return losses, lines[0]


def test_the_check_up_front_leaves_fsdp2_training_as_it_was(ranks):
    for strategy in ("ring", "ulysses"):
        losses, line = ranks(2).run(_up_front_under_fsdp, strategy)[0]
        assert losses["always"] == losses["never"] and losses["always checks"] == 1, losses
        assert ": exact;" in line and ("ulysses" in line) == (strategy == "ulysses"), line


def _plain(kind: str):
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.pos = nn.Linear(16, 48), nn.Embedding(64, 16)

        def forward(self, x, positions):
            where = torch.arange(x.shape[1]) if kind == "arange" else positions  # a shard's own index, or the buffer
            q, k, v = self.qkv(x + self.pos(where)).view(*x.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)

    model = Block()
    x = torch.randn(2, 32, 16, requires_grad=True)
    try:
        return cptune.check(model, {"x": x, "positions": torch.arange(32).expand(2, 32)}, model=model,
                            config=cptune.CPConfig(strategy="ulysses" if kind == "ulysses" else "ring")).line()
    except cptune.ValidationError as exc:
        return str(exc)


def test_a_plain_models_step_is_checked_the_same_way(ranks):
    group = ranks(2)
    for kind in ("buffer", "ulysses"):
        line = group.run(_plain, kind)[0]
        assert "first-step check of Block" in line and ": exact;" in line, line
    refused = group.run(_plain, "arange")[0]
    assert "step: Block fails cptune's first-step check" in refused and "the step's output by" in refused, refused
    assert "the gradient of pos.weight" in refused, refused


def test_the_checks_sequence_covers_twice_the_longest_reach_within_its_budget():
    assert _check.check_tokens({}, 32, None, None) == (128, [])
    assert _check.check_tokens({"sliding_window": 300}, 32, None, None) == (608, [])  # 600 up to the granule
    tokens, notes = _check.check_tokens({"attention_chunk_size": 8192}, 32, None, None)
    assert tokens == 4096 and notes == ["attention_chunk_size 8192 reaches beyond the check's 4096 tokens"]
    assert _check.check_tokens({"attention_chunk_size": 8192}, 32, 1024, None) == (1024, [])  # no longer than training
    assert _check.check_tokens({"sliding_window": 300}, 32, None, 250) == (256, ["sliding_window 300 reaches beyond "
                                                                               "the check's 256 tokens"])  # asked
    config = transformers.CONFIG_MAPPING["llama4_text"](attention_chunk_size=64, floor_scale=200, num_hidden_layers=2)
    assert _check.reaches(config) == {"attention_chunk_size": 64, "floor_scale": 200}


def test_bad_check_options_are_named():
    import cptune.hf
    from cptune import models

    model = models.build_model(M.tiny_config("llama"), "cpu")
    with pytest.raises(cptune.ValidationError, match="check: is 'sometimes'. Fix: use one of auto, always, never"):
        cptune.hf.enable(model, check="sometimes")
    with pytest.raises(cptune.ValidationError, match="check_tokens: is 0"):
        cptune.hf.enable(model, check_tokens=0)
