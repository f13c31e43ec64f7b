"""`generate` and `forward_batch` input checks: prompts of ints only (nothing coerced), a clear
error for a flat list, `eos_token_id` an int or a list of ints, and a step longer than
max_step_tokens refused by name. fp32 on the CPU reference backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4core.model import InputError
from dsv4core.model.api import load_model

#: logits compared with a bound of 2e-5 x max|logit| (fp32 rounding of the 4-layer tiny model;
#: the same bound as the engine tests, which measure ~1e-6 between chunked and whole prefills)
TOL = 2e-5


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", backend="reference")


@pytest.mark.parametrize("prompts, match", [
    ([1, 2, 3], r"flat list of 3 ints .*\[\[1, 2, 3\]\]"),
    ([[1, 2.0, 3]], r"prompt 0: token 1 is 2\.0 \(float\)"),
    ([[1, 2], [True, 3]], r"prompt 1: token 0 is True \(bool\)"),
    ([[1, "2"]], r"prompt 0: token 1 is '2' \(str\)"),
    ([[1, [2]]], r"prompt 0: token 1 is \[2\]"),
    ([torch.tensor([1.0, 2.0])], "prompt 0: expected a 1-D integer tensor"),
    ([np.array([1.5])], "prompt 0: expected a 1-D integer tensor"),
    ([7, [1, 2]], "prompt 0: expected a sequence of token ids"),
    ({"a": [1]}, "prompts must be a list"),
])
def test_bad_prompts_are_refused_not_coerced(tiny, prompts, match):
    with pytest.raises(InputError, match=match):
        tiny.generate(prompts, 2)
    assert not tiny.cache.live


def test_integer_prompts_of_every_kind_agree(tiny):
    want = tiny.generate([[5, 6, 7]], 3)
    assert tiny.generate([torch.tensor([5, 6, 7])], 3) == want
    assert tiny.generate([np.array([5, 6, 7], dtype=np.int32)], 3) == want
    assert tiny.generate([[np.int64(5), 6, 7]], 3) == want
    assert tiny.generate(torch.tensor([[5, 6, 7]]), 3) == want


def test_eos_list_stops_at_any_of_its_ids(tiny):
    prompts = [[5, 6, 7], list(range(20, 40)), [9]]
    free = tiny.generate(prompts, 10)
    eos = [free[0][2], free[1][4]]

    def cut(seq):  # greedy tokens do not depend on the stop ids: the free run, cut at the first stop
        for j, t in enumerate(seq):
            if t in eos:
                return seq[:j + 1]
        return seq

    want = [cut(s) for s in free]
    assert len(want[0]) <= 3 and len(want[1]) <= 5
    assert tiny.generate(prompts, 10, eos_token_id=eos) == want
    assert tiny.generate(prompts, 10, eos_token_id=tuple(eos)) == want
    assert tiny.generate(prompts, 10, eos_token_id=eos[0]) == [cut_one(s, eos[0]) for s in free]


def cut_one(seq, e):
    return seq[:seq.index(e) + 1] if e in seq else seq


@pytest.mark.parametrize("eos", ["1", 1.0, True, [1, "x"], [[1]]])
def test_bad_eos_is_refused(tiny, eos):
    with pytest.raises(InputError, match="eos_token_id must be None, an int or a list of ints"):
        tiny.generate([[1, 2]], 2, eos_token_id=eos)


def test_a_step_over_max_step_tokens_names_it_and_changes_nothing(tiny):
    ids = torch.randint(2, 256, (100,), generator=torch.Generator().manual_seed(1))
    whole = tiny.logits(ids)
    tiny.configure_cache(max_requests=2, max_tokens=2048, max_request_tokens=512, max_step_tokens=64)
    try:
        st = tiny.new_state()
        free = (len(tiny.cache.win_pool.free), len(tiny.cache.comp_pool.free))
        with pytest.raises(InputError, match="100 tokens in one step exceed the cache's max_step_tokens=64"):
            tiny.forward_batch(ids, torch.arange(100), torch.zeros(100, dtype=torch.long), [st])
        assert st.length == 0 and free == (len(tiny.cache.win_pool.free), len(tiny.cache.comp_pool.free))
        st.release()
        chunked = tiny.logits(ids)            # logits() steps through max_step_tokens at a time
        assert chunked.shape == whole.shape
        assert (chunked - whole).abs().max() <= TOL * whole.abs().max()
    finally:
        tiny.configure_cache()
