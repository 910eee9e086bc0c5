"""The loss without the whole logits (cptune/losses.py, cptune.hf.causal_lm_loss): torch's chunked
linear_cross_entropy and cptune's own checkpointed chunks equal the whole-logits loss and its gradients (float32,
1e-5), with ignored targets, a bias and softcapping; the head rule reads each family's transforms from its forward's
own code (Granite's logits_scaling, Cohere's logit_scale, Falcon-H1's lm_head_multiplier, Gemma's softcapping) and
names a head it does not know, which keeps the whole-logits loss. Every family's loss under CP through
causal_lm_loss is in the support matrix (tests/test_matrix.py)."""

import pytest
import torch
import torch.nn.functional as F

from cptune import models
from cptune import losses as _head
from cptune.losses import Head, head_of, loss_sum

transformers = pytest.importorskip("transformers")


def _whole(hidden, weight, labels, head, bias=None):
    logits = F.linear(hidden, weight, bias).float() * head.scale
    if head.softcap is not None:
        logits = torch.tanh(logits / head.softcap) * head.softcap
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum")


@pytest.mark.parametrize("head,bias,path,want_path", [
    (Head(), False, None, "torch"), (Head(scale=0.25), False, None, "torch"), (Head(), False, "cptune", "cptune"),
    (Head(softcap=3.0), False, None, "cptune"), (Head(scale=2.0), True, None, "cptune")])
def test_the_chunked_loss_equals_the_whole_logits_loss_and_gradients(head, bias, path, want_path):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 300, 32, generator=gen, requires_grad=True)
    weight = (torch.randn(1000, 32, generator=gen) * 0.1).requires_grad_()
    b = (torch.randn(1000, generator=gen) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, 1000, (2, 300), generator=gen)
    labels[0, :17] = -100
    want = _whole(hidden, weight, labels, head, b)
    grads = torch.autograd.grad(want, [hidden, weight] + ([b] if bias else []))
    got, ran = loss_sum(hidden, weight, labels, head, bias=b, chunk_tokens=128, path=path)
    assert ran == want_path
    for g, w in zip(torch.autograd.grad(got, [hidden, weight] + ([b] if bias else [])), grads):
        assert (g - w).abs().max() <= 1e-5 * w.abs().max(), (g - w).abs().max()
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())


def _vocab_parallel_case(softcap, bias):
    """On each rank: the vocabulary-parallel loss (rows of a 1,001-word head split unevenly over the ranks) against
    the whole-logits loss of the same tensors; (path, loss error, worst relative gradient error)."""
    import torch.distributed as dist

    head = Head(scale=0.5, softcap=softcap)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 300, 32, generator=gen, requires_grad=True)
    weight = (torch.randn(1001, 32, generator=gen) * 0.1).requires_grad_()
    b = (torch.randn(1001, generator=gen) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, 1001, (2, 300), generator=gen)
    labels[0, :17], labels[1, -3:] = -100, 1000  # ignored targets; the last rank's last row
    inputs = [hidden, weight] + ([b] if bias else [])
    want = _whole(hidden, weight, labels, head, b)
    grads = torch.autograd.grad(want, inputs)
    got, path = loss_sum(hidden, weight, labels, head, bias=b, chunk_tokens=128, group=dist.group.WORLD)
    worst = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(torch.autograd.grad(got, inputs), grads))
    return path, abs(got.item() - want.item()) / abs(want.item()), worst


@pytest.mark.parametrize("softcap,bias", [(None, False), (3.0, True)])
def test_the_vocabulary_parallel_loss_equals_the_whole_logits_loss_on_every_rank(ranks, softcap, bias):
    for path, loss, grads in ranks(2).run(_vocab_parallel_case, softcap, bias):
        assert path == "vocab-parallel" and loss <= 1e-5 and grads <= 1e-5, (path, loss, grads)


def _tiny(family, **fields):
    config = transformers.AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                               **fields)
    return transformers.AutoModelForCausalLM.from_config(config)


class _Shifted(transformers.LlamaForCausalLM):  # a head cptune does not know: it adds to the logits
    def forward(self, input_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids, **{k: v for k, v in kwargs.items() if k == "position_ids"})
        logits = self.lm_head(hidden.last_hidden_state)
        logits = logits + 1.0
        loss = None
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_the_head_rule_reads_each_familys_transforms_and_names_what_it_does_not_know():
    assert head_of(_tiny("llama")) == Head()
    assert head_of(_tiny("granite", logits_scaling=4.0)) == Head(scale=0.25)
    assert head_of(_tiny("cohere", logit_scale=0.5)) == Head(scale=0.5)
    assert head_of(_tiny("gemma3_text", final_logit_softcapping=30.0, head_dim=16)) == Head(softcap=30.0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    said = head_of(_Shifted(config))
    assert isinstance(said, str) and "'logits = logits + 1.0'" in said, said


def test_causal_lm_loss_is_the_models_own_loss_and_says_its_path():
    import cptune
    from cptune.hf import causal_lm_loss

    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    labels = cptune.shift_labels(ids)
    for model in (_tiny("llama"), _tiny("gemma3_text", final_logit_softcapping=3.0, head_dim=16)):
        model = models.prepare_for_training(model)
        want = model(input_ids=ids, labels=labels, shift_labels=labels).loss
        grads = torch.autograd.grad(want, list(model.parameters()))
        got = causal_lm_loss(model, ids, labels)
        assert abs(got.item() - want.item()) <= 1e-5 and model._cptune_loss_path in ("torch", "cptune")
        for g, w in zip(torch.autograd.grad(got, list(model.parameters())), grads):
            assert (g - w).abs().max() <= 1e-5 * max(w.abs().max().item(), 1e-12)
        assert model(input_ids=ids).logits.shape == (2, 24, 64)  # the model's own forward is unchanged
    assert _head.chunk_tokens_for(65536) == 512 and _head.chunk_tokens_for(10 ** 7) == _head.MIN_CHUNK
