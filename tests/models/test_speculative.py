"""Speculative decoding in ``generate`` (selfattn.models.speculative): greedy output equals plain
greedy output token for token (prompt lookup, the target as its own draft: every draft accepted,
a random draft: few accepted), across padded batches, a stop token inside an accepted run and
``max_new_tokens`` reached mid-run; sampling keeps the model's distribution (chi-square against
the exact probabilities, and a wrong rule fails the same test); the rule and the n-gram lookup
against their definitions; bad arguments.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from selfattn.models import speculative as spec
from selfattn.models.generate import generate
from tests._speculative import chi2_pvalue, exact_joint, tiny_llama

VOCAB = 97
ALPHA = 1e-4  # a distribution test fails below this p-value (seeded: the outcome is fixed)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def repeating_prompts(seed: int, B: int, pads) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, S)`` left-padded prompts that repeat their first tokens (prompt lookup finds them)."""
    g = random.Random(seed)
    S = 13
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.ones(B, S, dtype=torch.long)
    for b in range(B):
        n = S - pads[b]
        head = [g.randrange(VOCAB) for _ in range((n + 1) // 2)]
        row = (head + head)[:n]
        ids[b, pads[b] :] = torch.tensor(row)
        ids[b, : pads[b]] = g.randrange(VOCAB)  # padding holds tokens too: they must not count
        mask[b, : pads[b]] = 0
    return ids, mask


def count_calls(model):
    """A list that grows by one per forward of ``model``, and the hook's handle."""
    calls = []
    return calls, model.register_forward_pre_hook(lambda *_: calls.append(1))


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("B, pads", [(1, [0]), (4, [0, 5, 2, 11])])
@pytest.mark.parametrize("drafter", ["ngram", "self", "random"])
def test_greedy_equals_plain_greedy(target, drafter, B, pads, k):
    ids, mask = repeating_prompts(10 * k + B, B, pads)
    N = 23
    plain = generate(target, ids, N, attention_mask=mask, ignore_eos=True)
    if drafter == "ngram":
        kw = {"prompt_lookup_num_tokens": k}
    else:
        draft = target if drafter == "self" else tiny_llama(7, layers=1)
        kw = {"assistant_model": draft, "num_assistant_tokens": k}
    out = generate(target, ids, N, attention_mask=mask, ignore_eos=True, **kw)
    assert torch.equal(out, plain)


def test_own_draft_accepts_everything_and_random_draft_little(target):
    """The target drafting for itself: one verify forward per k + 1 tokens; a random draft:
    (almost) one token per forward, still the same tokens."""
    ids = torch.tensor([[5, 17, 3, 5, 17, 60, 2]])
    N, k = 25, 4
    plain = generate(target, ids, N, ignore_eos=True)
    twin = copy.deepcopy(target)  # the target's weights, its calls counted apart
    calls, hook = count_calls(target)
    try:
        own = generate(target, ids, N, ignore_eos=True, assistant_model=twin,
                       num_assistant_tokens=k)  # fmt: skip
        n_own = len(calls)
        calls.clear()
        rnd = generate(target, ids, N, ignore_eos=True, assistant_model=tiny_llama(3),
                       num_assistant_tokens=k)  # fmt: skip
        n_rnd = len(calls)
    finally:
        hook.remove()
    assert torch.equal(own, plain) and torch.equal(rnd, plain)
    # the prefill, then one verify step per k + 1 tokens after the first
    verify_calls = 1 + -(-(N - 1) // (k + 1))
    assert n_own == verify_calls
    assert n_rnd > 2 * verify_calls  # rejections: more verify steps than a perfect draft's


def test_stop_token_inside_an_accepted_run_and_max_new_mid_run(target):
    ids, mask = repeating_prompts(3, 3, [0, 4, 1])
    plain = generate(target, ids, 30, attention_mask=mask, ignore_eos=True)
    S = ids.shape[1]
    # a stop token first emitted by row 0 in the middle of its output (inside a k + 1 run of
    # the target drafting for itself); other rows stop there too or run on, padded after
    stop = int(plain[0, S + 9])
    ref = generate(target, ids, 30, attention_mask=mask, eos_token_id=stop, pad_token_id=0)
    for kw in ({"prompt_lookup_num_tokens": 4}, {"assistant_model": target}):
        out = generate(target, ids, 30, attention_mask=mask, eos_token_id=stop, pad_token_id=0,
                       **kw)  # fmt: skip
        assert torch.equal(out, ref), kw
    for n in (1, 2, 7, 11):  # max_new_tokens inside a run of k + 1 = 6
        ref = generate(target, ids, n, attention_mask=mask, ignore_eos=True)
        out = generate(target, ids, n, attention_mask=mask, ignore_eos=True,
                       assistant_model=target)  # fmt: skip
        assert torch.equal(out, ref), n


def test_streamer_sees_the_plain_steps(target):
    ids, mask = repeating_prompts(4, 2, [0, 3])
    seen, seen_spec = [], []
    generate(target, ids, 12, attention_mask=mask, ignore_eos=True, streamer=seen.append)
    generate(target, ids, 12, attention_mask=mask, ignore_eos=True, streamer=seen_spec.append,
             prompt_lookup_num_tokens=3)  # fmt: skip
    assert len(seen) == len(seen_spec) == 12
    assert all(torch.equal(a, b) for a, b in zip(seen, seen_spec))


# -- sampling keeps the distribution -------------------------------------------------------------
SMALL_V = 11
SAMPLES = 3000


@pytest.fixture(scope="module")
def small():
    return tiny_llama(1, vocab=SMALL_V), tiny_llama(2, vocab=SMALL_V, layers=1)


def sampled_pvalues(model, draft_kw, prompt, processing, seed):
    """p-values of the sampled (first, second) token pairs and of the third token, against
    the exact distribution."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt] * SAMPLES)
    out = generate(model, ids, 3, do_sample=True, generator=g, ignore_eos=True, **processing,
                   **draft_kw)[:, len(prompt) :]  # fmt: skip
    exact = exact_joint(model, prompt, 3, **processing)
    pairs = torch.zeros(SMALL_V, SMALL_V)
    pairs.index_put_((out[:, 0], out[:, 1]), torch.ones(SAMPLES), accumulate=True)
    third = torch.bincount(out[:, 2], minlength=SMALL_V)
    return chi2_pvalue(pairs, exact.sum(2)), chi2_pvalue(third, exact.sum((0, 1)))


PROMPT = [3, 7, 1, 3, 7, 1, 3]
CASES = {  # drafter -> its arguments; processing of p (and of the draft model's q)
    "ngram": ("lookup", {"temperature": 0.6}),
    "draft": ("other", {"temperature": 0.8, "top_k": 6}),
    "self": ("self", {"top_p": 0.85}),
}


def draft_kwargs(which: str, small):
    model, other = small
    if which == "lookup":
        return {"prompt_lookup_num_tokens": 3}
    return {"assistant_model": other if which == "other" else model, "num_assistant_tokens": 2}


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_keeps_the_models_distribution(small, case):
    which, processing = CASES[case]
    p_pairs, p_third = sampled_pvalues(small[0], draft_kwargs(which, small), PROMPT, processing,
                                       seed=len(case))  # fmt: skip
    assert p_pairs > ALPHA and p_third > ALPHA, (p_pairs, p_third)


RULE = spec.accept  # the right rule, kept while a test swaps in a wrong one


def _accept_every_draft(p, draft, q=None, generator=None):
    return [*draft, int(torch.multinomial(p[len(draft)].float(), 1, generator=generator))]


def _residual_is_p(p, draft, q=None, generator=None):
    """The rule with the residual forgotten: a rejected draft is redrawn from plain ``p``."""
    out = RULE(p, draft, q, generator)
    n = len(out) - 1
    if n < len(draft):
        out[-1] = int(torch.multinomial(p[n].float(), 1, generator=generator))
    return out


@pytest.mark.parametrize("wrong", [_accept_every_draft, _residual_is_p])
def test_a_wrong_rule_fails_the_distribution_test(small, monkeypatch, wrong):
    """The test above has the power to see a wrong rule."""
    monkeypatch.setattr(spec, "accept", wrong)
    which, processing = CASES["draft"] if wrong is _residual_is_p else CASES["ngram"]
    p_pairs, p_third = sampled_pvalues(small[0], draft_kwargs(which, small), PROMPT, processing,
                                       seed=5)  # fmt: skip
    assert min(p_pairs, p_third) < ALPHA


def test_accept_against_the_rule_by_enumeration():
    """One draft token: P(first emitted = y) = p(y) for random p, q (the rule's theorem),
    estimated from many seeded draws."""
    g = torch.Generator().manual_seed(0)
    V, n = 6, 20000
    p = torch.rand(2, V, generator=g).softmax(-1)
    q = torch.rand(1, V, generator=g).pow(3).softmax(-1)
    first = torch.zeros(V)
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=g))
        first[spec.accept(p, [x], q, g)[0]] += 1
    assert chi2_pvalue(first, p[0]) > ALPHA


# -- parts against their definitions -------------------------------------------------------------
def naive_lookup(tokens, k, hi, lo):
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            i = max(starts)
            return tokens[i + n : i + n + k]
    return []


def test_propose_ngram_matches_its_definition():
    g = random.Random(0)
    for _ in range(400):
        tokens = [g.randrange(4) for _ in range(g.randint(0, 30))]
        k, hi = g.randint(1, 6), g.randint(1, 4)
        lo = g.randint(1, hi)
        assert spec.propose_ngram(tokens, k, hi, lo) == naive_lookup(tokens, k, hi, lo)


def test_accept_greedy():
    assert spec.accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]
    assert spec.accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]
    assert spec.accept_greedy([8], []) == [8]


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"prompt_lookup_num_tokens": 0}, ValueError, "prompt_lookup_num_tokens"),
        ({"prompt_lookup_num_tokens": -2}, ValueError, "prompt_lookup_num_tokens"),
        ({"prompt_lookup_num_tokens": 2.0}, ValueError, "prompt_lookup_num_tokens"),
        ({"num_assistant_tokens": 3}, ValueError, "needs speculation"),
        ({"max_matching_ngram_size": 3}, ValueError, "needs speculation"),
        ({"prompt_lookup_num_tokens": 2, "max_matching_ngram_size": 0}, ValueError, "ngram_max"),
        ({"prompt_lookup_num_tokens": 2, "num_assistant_tokens": 2}, ValueError, "assistant"),
        ({"assistant_model": "draft"}, TypeError, "draft model must be"),
    ],
)
def test_bad_arguments_raise(target, kw, exc, match):
    with pytest.raises(exc, match=match):
        generate(target, torch.tensor([[1, 2, 3]]), 4, **kw)


def test_draft_vocabulary_and_k_are_checked(target):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"vocabulary \(11 tokens\) differs .* \(97\)"):
        generate(target, ids, 4, assistant_model=tiny_llama(0, vocab=11))
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        generate(target, ids, 4, assistant_model=target, num_assistant_tokens=0)
    with pytest.raises(ValueError, match="not both"):
        generate(target, ids, 4, assistant_model=target, prompt_lookup_num_tokens=2)
