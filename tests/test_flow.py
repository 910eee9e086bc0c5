"""The road a query tensor takes: from ``cptune.scaled_dot_product_attention`` through at most 7 of cptune's
modules, never climbing back to a module it left for a lower one. Traced on real gloo ranks, for every
strategy, with and without packed documents (the masked ring).

The block's torch-function mode (``attention._routing.SDPAMode``) is left out of the trace: torch's
dispatcher calls its ``__torch_function__`` for every torch call made while the block is open, as it
would any mode; none of cptune's code calls it."""

import sys

import pytest
import torch

import cptune

HEAD_DIM = 24  # no other tensor on the path ends in 24: the traced arguments that do are q, k, v and out
SEQ = 64


def _trace(strategy: str, documents: bool) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, SEQ, HEAD_DIM) for _ in range(3))
    docs = cptune.documents_from_lengths([16, 48]) if documents else None
    entered: list[str] = []  # modules whose functions took an attention tensor, in order
    chains: list[list[str]] = []  # cptune's modules on the stack at each call, outermost first
    with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2], config={"strategy": strategy, **({"ulysses_degree": 2} if strategy == "hybrid" else {})},
                                 documents=docs):

        def profile(frame, event, arg):
            if event != "call" or frame.f_code.co_name == "__torch_function__":
                return
            name = frame.f_globals.get("__name__", "")
            if not name.startswith("cptune"):
                return
            if any(isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[-1] == HEAD_DIM
                   for x in frame.f_locals.values()) and (not entered or entered[-1] != name):
                entered.append(name)
            chain, f = [], frame
            while f is not None:
                mod = f.f_globals.get("__name__", "")
                if f.f_code.co_name == "__torch_function__":
                    mod = ""
                if mod.startswith("cptune") and (not chain or chain[-1] != mod):
                    chain.append(mod)
                f = f.f_back
            chains.append(chain[::-1])

        sys.setprofile(profile)
        try:
            out = cptune.scaled_dot_product_attention(q, k, v, is_causal=True)
        finally:
            sys.setprofile(None)
    climbs = [c for c in chains if len(set(c)) < len(c)]
    return {"modules": sorted(set(entered)), "order": entered, "climbs": climbs[:3], "shape": tuple(out.shape)}


@pytest.mark.parametrize("strategy,documents", [("ring", False), ("ring", True), ("ulysses", False),
                                                ("ulysses", True), ("hybrid", False), ("hybrid", True)])
def test_a_query_enters_at_most_seven_modules_and_never_climbs_back(ranks, strategy, documents):
    for r in ranks(4).run(_trace, strategy, documents):
        assert r["order"][0] == "cptune.context" and "cptune._session" not in r["modules"], r
        assert len(r["modules"]) <= 7, r
        assert not r["climbs"], r
        assert r["shape"] == (1, 4, SEQ // 4, HEAD_DIM)
