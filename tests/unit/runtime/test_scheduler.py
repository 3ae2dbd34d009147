"""The scheduler (the engine's request loop) over the dense reference model in float64, without
Ray: log-probabilities and penalties against hand computations on the reference's logits, and
prompts that must be refused without harming the requests beside them."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from powerinfer_ray.model.reference import ReferenceModel
from powerinfer_ray.model.source import open_model
from powerinfer_ray.model.tiny import write_tiny_model
from powerinfer_ray.runtime.engine import make_tokenizer
from powerinfer_ray.runtime.scheduler import Scheduler

N_CTX = 96


class ReferenceSteps:
    """A step function over the dense reference: one KV cache per slot, new when a slot starts at 0;
    with a fourth argument, a Burst: its decode steps back to back (as the primary's ``serve_step``;
    a greedy burst asks each step for the argmax alone).
    ``calls``: each call's (batch, the burst's steps or 0)."""

    def __init__(self, ref: ReferenceModel) -> None:
        self.ref, self.caches, self.calls = ref, {}, []

    async def __call__(self, slots, tokens, start, burst=None):
        self.calls.append((len(slots), burst.n if burst else 0))
        if burst is None:
            return await asyncio.to_thread(self.step, slots, tokens, start)  # off the loop, as the engine's
        return burst.run(lambda toks, pos, argmax=False: self.step(slots, toks, pos, argmax), [t[0] for t in tokens],
                         start)

    def step(self, slots, tokens, start, argmax=False):
        out = []
        for s, t, p in zip(slots, tokens, start):
            if p == 0:
                self.caches[s] = self.ref.new_cache()
            assert self.caches[s].length == p, (s, self.caches[s].length, p)
            out.append(self.ref.forward(t, self.caches[s])[-1].numpy())
        return np.stack(out).argmax(-1) if argmax else np.stack(out)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("sched") / "m.gguf", "llama-reglu", seed=11, n_layer=2,
                            n_ctx=N_CTX)
    return ReferenceModel.from_file(path, dtype=torch.float64), make_tokenizer(open_model(path).fields)


def _scheduler(model, **kw) -> Scheduler:
    ref, tok = model
    return Scheduler(ReferenceSteps(ref), tok, n_ctx=N_CTX, max_batch=4, prefill_chunk=8, n_vocab=ref.cfg.n_vocab,
                     **kw)


def _log_softmax(x: torch.Tensor) -> np.ndarray:
    return torch.log_softmax(x.double(), -1).numpy()


def test_logprobs_equal_the_log_softmax_of_the_reference_logits(model):
    ref, _ = model
    prompt = [5, 77, 190, 33, 12, 99]
    out = asyncio.run(_scheduler(model).generate(prompt_token_ids=prompt, max_tokens=6, ignore_eos=True,
                                                 logprobs=3, prompt_logprobs=2))
    ids = prompt + out["token_ids"]
    lp = _log_softmax(ref.forward(ids, ref.new_cache()))  # [T, V]: row t scores token t + 1
    assert out["token_ids"] == ref.generate_greedy(prompt, 6)
    for k, e in enumerate(out["logprobs"]):
        row = lp[len(prompt) - 1 + k]
        assert e["token_id"] == ids[len(prompt) + k]
        np.testing.assert_allclose(e["logprob"], row[e["token_id"]], atol=1e-5)
        top = np.argsort(-row)[:3]
        assert [a["token_id"] for a in e["top"]] == list(top)
        np.testing.assert_allclose([a["logprob"] for a in e["top"]], row[top], atol=1e-5)
    first, *rest = out["prompt_logprobs"]
    assert first["token_id"] == prompt[0] and first["logprob"] is None
    assert [e["token_id"] for e in rest] == prompt[1:]
    np.testing.assert_allclose([e["logprob"] for e in rest], [lp[i][prompt[i + 1]] for i in range(len(prompt) - 1)],
                               atol=1e-5)
    assert all(len(e["top"]) == 2 for e in rest)


def test_streamed_logprobs_are_the_same(model):
    async def run():
        sched = _scheduler(model)
        chunks = [c async for c in sched.generate_stream(prompt_token_ids=[9, 8, 7], max_tokens=5, ignore_eos=True,
                                                         logprobs=1, prompt_logprobs=0)]
        whole = await sched.generate(prompt_token_ids=[9, 8, 7], max_tokens=5, ignore_eos=True, logprobs=1,
                                     prompt_logprobs=0)
        return chunks, whole

    chunks, whole = asyncio.run(run())
    assert [e for c in chunks for e in c["logprobs"]] == whole["logprobs"]
    assert chunks[0]["prompt_logprobs"] == whole["prompt_logprobs"]  # with the first chunk, once
    assert all("prompt_logprobs" not in c for c in chunks[1:])


def test_an_output_ending_mid_character_ends_as_decode_gives_it(model):
    """A stream holds back a character's first bytes until its last one comes; an output that ends
    before it comes (here at max_tokens) ends as tok.decode(ids) does, with U+FFFD, streamed and whole."""
    ref, tok = model
    script = tok.encode("a\u2192", add_bos=False)[:-1]  # 'a', then two of the arrow's three bytes
    assert tok.decode(script[:2]) == "a\ufffd" and len(script) == 3

    async def scripted(slots, tokens, start):  # the script's next token: one-hot logits
        n = start[0] + len(tokens[0]) - len(prompt)  # tokens generated before this step
        out = np.zeros((len(slots), ref.cfg.n_vocab))
        out[:, script[n]] = 1.0
        return out

    prompt = [9, 8, 7]

    async def run():
        sched = Scheduler(scripted, tok, n_ctx=N_CTX, max_batch=2, prefill_chunk=8, n_vocab=ref.cfg.n_vocab)
        chunks = [c async for c in sched.generate_stream(prompt_token_ids=prompt, max_tokens=3, ignore_eos=True)]
        return chunks, await sched.generate(prompt_token_ids=prompt, max_tokens=3, ignore_eos=True)

    chunks, whole = asyncio.run(run())
    assert whole["token_ids"] == script and whole["text"] == tok.decode(script) == "a\ufffd"
    assert "".join(c["text"] for c in chunks) == whole["text"]
    # per token: the arrow's first byte held back while the output went on, then U+FFFD at its end
    assert [c["text"] for c in chunks if c["token_ids"]] == ["a", "", "\ufffd"]


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 0.8), (0.6, 0.9), (-1.0, 0.0)])
def test_penalties_follow_openai_on_the_reference(model, presence, frequency):
    """Greedy under penalties equals a hand loop: logits - frequency * count - presence * (count > 0)."""
    ref, _ = model
    prompt, n = [40, 41, 42, 43], 16
    cache = ref.new_cache()
    logits, counts, want = ref.forward(prompt, cache)[-1], np.zeros(ref.cfg.n_vocab), []
    for _ in range(n):
        x = logits.numpy() - frequency * counts - presence * (counts > 0)
        tok = int(np.argmax(x))
        want.append(tok)
        counts[tok] += 1
        logits = ref.forward([tok], cache)[-1]
    got = asyncio.run(_scheduler(model).generate(prompt_token_ids=prompt, max_tokens=n, ignore_eos=True,
                                                 presence_penalty=presence, frequency_penalty=frequency))
    assert got["token_ids"] == want
    assert want != ref.generate_greedy(prompt, n)  # the penalties changed the output: the test is not vacuous


def test_out_of_vocabulary_ids_are_refused_and_the_others_finish(model):
    ref, _ = model

    async def run():
        sched = _scheduler(model)
        good = [asyncio.ensure_future(sched.generate(prompt_token_ids=[3 + i, 4, 5], max_tokens=8, ignore_eos=True))
                for i in range(3)]
        for bad in ([5000], [-1], [1, ref.cfg.n_vocab], [True]):
            with pytest.raises(ValueError, match="prompt_token_ids"):
                await sched.generate(prompt_token_ids=bad, max_tokens=2)
        return await asyncio.gather(*good), sched.stats()

    outs, st = asyncio.run(run())
    assert [o["token_ids"] for o in outs] == [ref.generate_greedy([3 + i, 4, 5], 8) for i in range(3)]
    assert st["failed"] == 0 and st["running"] == st["waiting"] == 0


def test_a_huge_prompt_is_refused_without_stalling_the_loop(model):
    """10 MB of text cannot fit in the context: refused by its size, never tokenized (tokenizing
    it took the engine ~30 s on 2 cores, during which every stream stalled)."""
    ref, tok = model

    async def run():
        sched = _scheduler(model)
        stream = asyncio.ensure_future(sched.generate(prompt_token_ids=[7, 8], max_tokens=40, ignore_eos=True))
        gaps, stop = [], asyncio.Event()

        async def ticker():
            while not stop.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                gaps.append(time.perf_counter() - t)

        tick = asyncio.ensure_future(ticker())
        with pytest.raises(ValueError, match="cannot fit in the context"):
            await sched.generate("All work and no play. " * 460_000, max_tokens=2)
        out = await stream
        stop.set()
        await tick
        return out, max(gaps)

    calls = []
    encode = tok.encode
    tok.encode = lambda text, *a, **kw: calls.append(len(text)) or encode(text, *a, **kw)
    try:
        out, worst = asyncio.run(run())
    finally:
        tok.encode = encode
    assert calls == [] and worst < 1.0
    assert out["token_ids"] == ref.generate_greedy([7, 8], 40)


def test_max_tokens_must_fit_the_context_and_none_fills_it(model):
    prompt = list(range(10, 30))
    sched = _scheduler(model)
    with pytest.raises(ValueError, match=r"max_tokens is 100.*at most 76 new tokens"):
        asyncio.run(sched.generate(prompt_token_ids=prompt, max_tokens=100))
    out = asyncio.run(sched.generate(prompt_token_ids=prompt, max_tokens=None, ignore_eos=True))
    assert len(out["token_ids"]) == N_CTX - len(prompt) and out["finish_reason"] == "length"


def test_text_prompts_are_checked(model):
    sched = _scheduler(model)
    for prompt, words in (("\ud800", "not valid Unicode"), ("", "empty"), (42, "string")):
        with pytest.raises(ValueError, match=words):
            asyncio.run(sched.generate(prompt, max_tokens=2))


def test_each_finished_request_reports_its_timings(model):
    seen = []

    async def run():
        sched = _scheduler(model, on_finish=seen.append)
        return await asyncio.gather(*(sched.generate(prompt_token_ids=[5, 6, i], max_tokens=4, ignore_eos=True)
                                      for i in range(6)))  # 6 requests, 4 slots: two wait in the queue

    outs = asyncio.run(run())
    assert sorted(r.id for r in seen) == sorted(o["id"] for o in outs)
    for r in seen:
        t = r.timings()
        assert 0 <= t["queue_s"] <= t["ttft_s"] <= t["total_s"] and t["tpot_s"] > 0


class RecordedSteps(ReferenceSteps):
    """ReferenceSteps that keep each step's shape (sequences, tokens each)."""

    def __init__(self, ref: ReferenceModel) -> None:
        super().__init__(ref)
        self.shapes = []

    def step(self, slots, tokens, start):
        self.shapes.append((len(tokens), len(tokens[0])))
        return super().step(slots, tokens, start)


@pytest.mark.parametrize("lengths, first", [((3, 3, 3, 3), (4, 2)), ((9, 2, 5), (1, 8)), ((2, 6, 6), (3, 2))])
def test_prompts_queued_together_prefill_in_shared_steps(model, lengths, first):
    """Prompts queued at once share prefill steps (prefill_chunk 8: B sequences x T tokens <= 8, T
    at most the fewest any of them has left, the B that runs the most tokens); each request's
    greedy tokens equal its own run alone, and every prompt token is computed once."""
    ref, tok = model
    prompts = [[5 + 3 * i + j for j in range(n)] for i, n in enumerate(lengths)]

    async def run(ps):
        steps = RecordedSteps(ref)
        sched = Scheduler(steps, tok, n_ctx=N_CTX, max_batch=4, prefill_chunk=8, n_vocab=ref.cfg.n_vocab)
        outs = await asyncio.gather(*(sched.generate(prompt_token_ids=p, max_tokens=4, temperature=0,
                                                      ignore_eos=True) for p in ps))
        return [o["token_ids"] for o in outs], steps.shapes, sched.stats()

    together, shapes, stats = asyncio.run(run(prompts))
    assert shapes[0] == first
    assert all(b * t <= 8 for b, t in shapes)
    assert stats["prompt_tokens"] == sum(lengths)
    for p, ids in zip(prompts, together):
        alone, _, _ = asyncio.run(run([p]))
        assert ids == alone[0]


def test_greedy_bursts_equal_the_reference_and_end_where_each_request_ends(model):
    """With decode_burst 4, greedy requests decoded together run up to 4 steps a call (never past a
    request's last token): each output is the reference's greedy continuation, cut at max_tokens or at
    a stop token met inside a burst; a request that asks for logprobs runs one step a call."""
    ref, _ = model
    prompts = [[5, 77, 190], [33, 12, 99, 4], [61, 62]]
    want = [ref.generate_greedy(p, 9) for p in prompts]
    stop = want[2][2]  # the third request stops at its third token, inside a burst
    assert stop not in want[2][:2]
    steps = ReferenceSteps(ref)
    sched = Scheduler(steps, None, n_ctx=N_CTX, max_batch=4, prefill_chunk=8, n_vocab=ref.cfg.n_vocab, decode_burst=4)

    async def main():  # noqa: ANN202
        return await asyncio.gather(sched.generate(prompt_token_ids=prompts[0], max_tokens=9, ignore_eos=True),
                                    sched.generate(prompt_token_ids=prompts[1], max_tokens=6, ignore_eos=True),
                                    sched.generate(prompt_token_ids=prompts[2], max_tokens=9, ignore_eos=True,
                                                   stop_token_ids=[stop]))

    outs = asyncio.run(main())
    assert outs[0]["token_ids"] == want[0] and outs[1]["token_ids"] == want[1][:6]
    assert outs[2]["token_ids"] == want[2][:2] and outs[2]["finish_reason"] == "stop"
    bursts = [n for _, n in steps.calls if n]
    assert bursts and max(bursts) == 4  # bursts ran, none past a request's max_tokens (the 6 left 5 at first)
    # the tokens decode steps gave and the requests took (the first comes from the prompt's step; the
    # third's last is its stop token; what a burst computed after a request's end is not counted)
    assert sched.stats()["decode_tokens"] == (9 - 1) + (6 - 1) + (3 - 1)

    sampled = ReferenceSteps(ref)
    sched = Scheduler(sampled, None, n_ctx=N_CTX, max_batch=4, prefill_chunk=8, n_vocab=ref.cfg.n_vocab, decode_burst=4)

    async def mixed():  # noqa: ANN202
        return await asyncio.gather(sched.generate(prompt_token_ids=prompts[0], max_tokens=5, ignore_eos=True),
                                    sched.generate(prompt_token_ids=prompts[1], max_tokens=5, ignore_eos=True,
                                                   logprobs=1))

    outs = asyncio.run(mixed())
    assert outs[0]["token_ids"] == want[0][:5] and outs[1]["token_ids"] == want[1][:5]
    assert all(n == 0 for _, n in sampled.calls)  # logprobs need every step's logits


def test_sampled_bursts_equal_single_steps_with_the_same_seeds(model):
    """Seeded sampling in bursts (temperature, top-k, top-p; beside a greedy request) gives the tokens
    that one step a call gives, where the scheduler samples each from the step's logits with the
    request's generator; a request with a penalty keeps its batch to one step a call."""
    ref, _ = model
    prompts = [[5, 77, 190], [33, 12, 99, 4], [61, 62]]
    kws = [dict(temperature=0.9, seed=7), dict(temperature=1.3, top_k=20, top_p=0.9, seed=11), {}]

    async def run(burst, extra=None):  # noqa: ANN001, ANN202
        steps = ReferenceSteps(ref)
        sched = Scheduler(steps, None, n_ctx=N_CTX, max_batch=4, prefill_chunk=8, n_vocab=ref.cfg.n_vocab,
                          decode_burst=burst)
        outs = await asyncio.gather(*(sched.generate(prompt_token_ids=p, max_tokens=9, ignore_eos=True, **kw)
                                      for p, kw in zip(prompts, [dict(kw, **(extra or {})) for kw in kws])))
        return [o["token_ids"] for o in outs], [n for _, n in steps.calls]

    single, calls = asyncio.run(run(1))
    assert not any(calls)
    burst, calls = asyncio.run(run(4))
    assert max(calls) == 4
    assert burst == single
    assert single[0] != ref.generate_greedy(prompts[0], 9) and single[2] == ref.generate_greedy(prompts[2], 9)
    _, calls = asyncio.run(run(4, dict(frequency_penalty=0.5)))
    assert not any(calls)  # penalties need the tokens so far: every step's logits come here


def test_greedy_bursts_go_on_while_requests_wait_for_a_slot(model):
    """At capacity (one slot, a second request queued) the running request still decodes in bursts;
    the queued one starts after it ends, and both are the reference's greedy continuations."""
    ref, _ = model
    prompts = [[5, 77, 190], [33, 12, 99, 4]]
    steps = ReferenceSteps(ref)
    sched = Scheduler(steps, None, n_ctx=N_CTX, max_batch=1, prefill_chunk=8, n_vocab=ref.cfg.n_vocab, decode_burst=4)

    async def main():  # noqa: ANN202
        return await asyncio.gather(*[sched.generate(prompt_token_ids=p, max_tokens=9, ignore_eos=True)
                                      for p in prompts])

    outs = asyncio.run(main())
    assert [o["token_ids"] for o in outs] == [ref.generate_greedy(p, 9) for p in prompts]
    # each: its prompt's step, then 8 decode steps in two bursts of 4 (the first while the other waits)
    assert steps.calls == [(1, 0), (1, 4), (1, 4)] * 2
