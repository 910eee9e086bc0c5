"""A transformers causal LM trained under cptune equals one process: loss and parameter gradients.

Trained the way transformers trains (``model.train()``, gradient checkpointing,
``use_cache=False``, global ``position_ids``), with load balancing and ``-100`` labels spread
unevenly over the ranks.
"""

import pytest
import torch
import torch.distributed as dist

import cptune


transformers = pytest.importorskip("transformers")

TOL = 1e-5


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _batch(step, batch=2, seq_len=32):
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 128, (batch, seq_len), generator=gen)
    labels = ids.clone()
    labels[0, :11] = -100  # a prompt masked out: all on the first ranks' shards
    labels[1, -3:] = -100  # and a padded tail
    return ids, labels, torch.arange(seq_len).expand(batch, seq_len)


def _hf_case(steps, rotate, checkpointing, compiled=False, **strategy):
    import cptune.hf

    ref, model = _llama(), _llama()
    cptune.hf.enable(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for m in (ref, model):
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable()
    run = torch.compile(model) if compiled else model
    world = dist.get_world_size()
    config = cptune.CPConfig(rotate_method=rotate, load_balance="auto" if strategy else True, **strategy)
    results = []
    for step in range(steps):
        ids, labels, positions = _batch(step)
        ref_loss = ref(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss
        ref_loss.backward()

        shifted = cptune.shift_labels(labels)
        with cptune.context_parallel(buffers=[ids, shifted, positions], seq_dims=[1, 1, 1], config=config):
            loss = run(input_ids=ids, position_ids=positions, shift_labels=shifted, use_cache=False).loss
            loss.backward()
        loss = loss.detach()
        dist.all_reduce(loss)
        grad_err = 0.0
        for p, r in zip(model.parameters(), ref.parameters()):
            dist.all_reduce(p.grad)  # what FSDP/DDP do: average over ranks
            p.grad /= world
            grad_err = max(grad_err, (p.grad - r.grad).abs().max().item())
        results.append({"loss_err": abs(loss.item() / world - ref_loss.item()), "grad_err": grad_err})
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return results


@pytest.mark.parametrize("world,rotate,checkpointing", [(2, "alltoall", True), (4, "allgather", True),
                                                        (2, "allgather", False)])
def test_llama_trains_like_one_process(ranks, world, rotate, checkpointing):
    for per_rank in ranks(world).run(_hf_case, 3, rotate, checkpointing):
        for r in per_rank:
            assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, per_rank


@pytest.mark.parametrize("world,strategy", [(2, {"strategy": "ulysses"}), (4, {"strategy": "ulysses"}),
                                            (4, {"strategy": "hybrid", "ulysses_degree": 2})])
def test_llama_trains_like_one_process_under_ulysses_and_hybrid(ranks, world, strategy):
    for per_rank in ranks(world).run(_hf_case, 2, "alltoall", True, **strategy):
        for r in per_rank:
            assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, per_rank


def test_compiled_llama_with_checkpointing(ranks):
    for per_rank in ranks(2).run(_hf_case, 2, "alltoall", True, True):
        for r in per_rank:
            assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, per_rank


def _hf_mistake_case(mistake):
    import cptune.hf

    model = cptune.hf.enable(_llama())
    ids, labels, positions = _batch(0)
    kwargs = {"input_ids": ids, "position_ids": positions, "labels": ids, "use_cache": False}
    buffers = [ids, positions]
    if mistake == "positions":
        kwargs.pop("position_ids")
    elif mistake == "mask":
        mask = torch.ones_like(ids)
        mask[0, -4:] = 0
        kwargs["attention_mask"] = mask
        buffers.append(mask)
    try:
        with cptune.context_parallel(buffers=buffers, seq_dims=[1] * len(buffers)):
            model(**kwargs)
    except cptune.ValidationError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("mistake,named", [("labels", "shift_labels"), ("positions", "position_ids"),
                                           ("mask", "attention_mask")])
def test_silent_mistakes_are_refused(ranks, mistake, named):
    for message in ranks(2).run(_hf_mistake_case, mistake):
        assert named in message and "Fix:" in message, message


# -- packed batches and sliding windows: silently wrong before cptune knew documents ---------------


def _packed_batch(flash_kwargs=False):
    """Three documents packed the way transformers packs them (DataCollatorWithFlattening): one row,
    position_ids restarting at 0 in every document, -100 labels at each document's first token."""
    from transformers import DataCollatorWithFlattening

    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (20, 7, 37)]  # 64 tokens
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    return collate([{"input_ids": d} for d in docs])


def _packed_case(rotate, flash_kwargs, steps=2, named=False, **strategy):
    """``named``: the buffers as a dict with the position ids under 'position_ids', so the block reads the
    packing when it opens (and deals by work); else a list, the packing reaching the block with the model call."""
    import cptune.hf

    batch = _packed_batch(flash_kwargs)
    ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
    extra = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k") if k in batch}
    ref, model = _llama(), _llama()
    cptune.hf.enable(model)
    world = dist.get_world_size()
    config = cptune.CPConfig(rotate_method=rotate, **strategy)
    results = []
    for _ in range(steps):
        for m in (ref, model):
            m.zero_grad()
        ref_out = ref(input_ids=ids, position_ids=positions, labels=labels, use_cache=False)
        ref_out.loss.backward()
        shifted = cptune.shift_labels(labels)
        buffers = [ids, shifted, positions]
        if named:
            buffers = {"input_ids": ids, "shift_labels": shifted, "position_ids": positions}
        with cptune.context_parallel(buffers=buffers, seq_dims=[1, 1, 1] if not named else dict.fromkeys(buffers, 1),
                                     config=config) as cp:
            out = model(input_ids=ids, position_ids=positions, shift_labels=shifted, use_cache=False, **extra)
            out.loss.backward()
            logits = cp.unshard(out.logits, 1)
            chunks = cp._require().layout.chunks
        loss = out.loss.detach()
        dist.all_reduce(loss)
        grad_err = 0.0
        for p, r in zip(model.parameters(), ref.parameters()):
            dist.all_reduce(p.grad)
            grad_err = max(grad_err, (p.grad / world - r.grad).abs().max().item())
        results.append({"loss_err": abs(loss.item() / world - ref_out.loss.item()), "grad_err": grad_err,
                        "logits_err": (logits - ref_out.logits).abs().max().item(), "chunks": chunks})
    return results


@pytest.mark.parametrize("world,rotate,flash_kwargs,strategy", [
    (2, "alltoall", False, {}), (4, "allgather", True, {}), (2, "alltoall", False, {"strategy": "ulysses"}),
    (4, "alltoall", False, {"strategy": "hybrid", "ulysses_degree": 2})])
def test_a_packed_batch_trains_like_one_process(ranks, world, rotate, flash_kwargs, strategy):
    for per_rank in ranks(world).run(_packed_case, rotate, flash_kwargs, **strategy):
        for r in per_rank:
            assert r["loss_err"] <= TOL and r["grad_err"] <= TOL and r["logits_err"] <= TOL, per_rank


@pytest.mark.parametrize("world,rotate", [(2, "alltoall"), (4, "allgather")])
def test_position_ids_named_in_the_buffers_deal_a_packed_batch_by_work_when_the_block_opens(ranks, world, rotate):
    """The same packed batch, the block told nothing but the buffers' names: the tokens are dealt by work as
    documents= deals them (not head-tail), and the step still equals one process."""
    from cptune.attention import documents_from_position_ids, token_work, work_chunks

    want = work_chunks(token_work(documents_from_position_ids(_packed_batch()["position_ids"]), 64, True, None),
                       world)[0]
    assert want != tuple((r, 2 * world - 1 - r) for r in range(world))  # dealt by work, not head-tail
    for per_rank in ranks(world).run(_packed_case, rotate, False, steps=1, named=True):
        for r in per_rank:
            assert r["chunks"] == want and r["loss_err"] <= TOL and r["grad_err"] <= TOL and r["logits_err"] <= TOL, r


def _late_packing_case():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _packed_case("alltoall", False, steps=1)
    return results[0]["chunks"], [str(w.message) for w in caught if "reached the block" in str(w.message)]


def test_a_packing_that_reaches_the_block_late_says_how_to_deal_it_by_work(ranks):
    chunks, said = ranks(2).run(_late_packing_case)[0]
    assert chunks is None and len(said) == 1 and "'position_ids'" in said[0], said


def _mistral_window_case(rotate):
    import cptune.hf
    from transformers import MistralConfig, MistralForCausalLM

    def build():
        torch.manual_seed(0)
        return MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=256, sliding_window=16,
                                                attn_implementation="sdpa"))

    ref, model = build(), cptune.hf.enable(build())
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (1, 128), generator=gen)
    positions = torch.arange(128).expand(1, 128)
    ref_logits = ref(input_ids=ids, position_ids=positions, use_cache=False).logits
    ref_logits.square().mean().backward()
    with cptune.context_parallel(buffers=[ids, positions], seq_dims=[1, 1],
                                 config=cptune.CPConfig(rotate_method=rotate)) as cp:
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        (cp.cp_size * logits.square().sum() / ref_logits.numel()).backward()
        full = cp.unshard(logits, 1)
    world = dist.get_world_size()
    grad_err = 0.0
    for p, r in zip(model.parameters(), ref.parameters()):
        dist.all_reduce(p.grad)
        grad_err = max(grad_err, (p.grad / world - r.grad).abs().max().item())
    outside = model(input_ids=ids, position_ids=positions, use_cache=False).logits  # one device, after the block
    return {"logits_err": (full - ref_logits).abs().max().item(), "grad_err": grad_err,
            "outside_err": (outside - ref_logits).abs().max().item()}


@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_a_sliding_window_model_matches_one_process(ranks, rotate):
    for r in ranks(2).run(_mistral_window_case, rotate):
        assert r["logits_err"] <= TOL and r["grad_err"] <= TOL and r["outside_err"] <= TOL, r


def _not_enabled_case():
    model = _llama()  # transformers' own SDPA attention: no cptune.hf.enable
    ids, _, positions = _batch(0)
    try:
        with cptune.context_parallel(buffers=[ids, positions], seq_dims=[1, 1]):
            model(input_ids=ids, position_ids=positions, use_cache=False)
    except cptune.ValidationError as exc:
        return str(exc)
    return "no error"


def test_a_model_not_prepared_by_hf_enable_is_refused_naming_it(ranks):
    for message in ranks(2).run(_not_enabled_case):
        assert "model: is a transformers model" in message and "cptune.hf.enable(model)" in message, message
