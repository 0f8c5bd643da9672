"""weights.groundtruth: task generators and encoding, the tokenizer, the training data, forward,
config and command line, and smoke training runs (loss goes down, orbax checkpoint + resume, exact
export that weights.load_model loads)."""

from __future__ import annotations

import json
import random
import re
import shlex
import shutil
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.models import decoder
from jaxserve.models.params import build_params, hf_shapes
from jaxserve.tokenizer import Tokenizer
from weights import load_model
from weights.groundtruth import architecture, data, evaluate, export, forward, loop, start, tasks, train
from weights.groundtruth import tokenizer as gt_tokenizer
from weights.groundtruth.config import TrainConfig


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(gt_tokenizer.save(tmp_path_factory.mktemp("gt_tok")))


def _count(tok):
    return lambda s: len(tok.encode(s))


# ---------------------------------------------------------------------------------------------
# Tasks.
# ---------------------------------------------------------------------------------------------


def test_arithmetic_exact_form_and_answer():
    rng = random.Random(0)
    ops = set()
    for _ in range(500):
        msgs = tasks.arithmetic(rng)
        m = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", msgs[0]["content"])
        assert m and msgs[0]["role"] == "user" and msgs[1]["role"] == "assistant"
        a, op, b = int(m[1]), m[2], int(m[3])
        assert 0 <= a <= 9999 and 0 <= b <= 9999 and str(a) == m[1] and str(b) == m[3]
        assert msgs[1]["content"] == str(a + b if op == "+" else a - b) == tasks.answer_of(msgs)
        ops.add(op)
    assert ops == {"+", "-"}


def test_needle_exact_form_and_length(tok):
    rng = random.Random(1)
    for target in (1000, 2500, 4000):
        msgs = tasks.needle(rng, target, _count(tok))
        context, question = msgs[0]["content"].split("\n\n")
        lines = context.split("\n")
        codes = {}
        for line in lines:
            m = re.fullmatch(r"The code for ([A-Z][a-z]+) is (\d{6})\.", line)
            assert m, line
            assert m[1] not in codes
            codes[m[1]] = m[2]
        q = re.fullmatch(r"What is the code for ([A-Z][a-z]+)\?", question)
        assert q and msgs[1]["content"] == codes[q[1]] == tasks.answer_of(msgs)
        n = len(tok.encode(context))
        assert target <= n <= target + 40, (target, n)


def test_needle_training_follow_ups_ask_about_the_same_context(tok):
    rng = random.Random(2)
    msgs = tasks.needle(rng, 300, _count(tok), follow_ups=5)
    assert len(msgs) == 12 and tasks.answer_of(msgs[:2]) == msgs[1]["content"]
    codes = dict(re.findall(r"The code for ([A-Z][a-z]+) is (\d{6})\.", msgs[0]["content"]))
    asked = []
    for q, a in zip(msgs[2::2], msgs[3::2]):
        m = re.fullmatch(r"What is the code for ([A-Z][a-z]+)\?", q["content"])
        assert q["role"] == "user" and a["role"] == "assistant" and m and codes[m[1]] == a["content"]
        asked.append(m[1])
    assert len(set(asked)) == 5
    # probes keep the one-question form
    assert all(len(p.messages) == 1 for p in tasks.probes(3, needle_tokens=(100, 200)) if p.kind == "needle")


def test_shared_prefix_needles_plant_distractors_that_start_like_each_asked_code(tok):
    """--needle-shared: each asked code gets 1-3 other lines whose codes share its first 1-5 digits
    and differ right after; every answer is still its line's code; at 0 no draw is made."""
    rng = random.Random(3)
    for _ in range(30):
        msgs = tasks.needle(rng, 400, _count(tok), follow_ups=4, shared_prefix=1.0)
        lines = re.findall(r"The code for ([A-Z][a-z]+) is (\d{6})\.", msgs[0]["content"])
        codes = dict(lines)
        assert len(codes) == len(lines)  # names still distinct
        asked = [re.search(r"code for ([A-Z][a-z]+)\?", q["content"])[1] for q in msgs[0::2]]
        assert all(codes[n] == a["content"] for n, a in zip(asked, msgs[1::2]))
        for n in set(asked):
            alike = [c for m, c in lines if m not in asked and c[0] == codes[n][0]]
            assert alike and all(c != codes[n] for c in alike)
    r1, r2 = random.Random(9), random.Random(9)
    assert ([tasks.needle(r1, 300, _count(tok), 3) for _ in range(5)]
            == [tasks.needle(r2, 300, _count(tok), 3, shared_prefix=0.0) for _ in range(5)])
    assert r1.random() == r2.random()
    with pytest.raises(ValueError, match="fraction"):
        TrainConfig("/nonexistent", 1, smoke=True, needle_shared=-0.1)


def test_echo_restates_context_lines_and_supervises_only_their_codes(tok):
    rng = random.Random(5)
    for _ in range(20):
        segs = tasks.needle_echo(rng, rng.randint(20, 300), _count(tok))
        text = "".join(t for t, _ in segs)
        context, echoes = text.split("\n\n")
        codes = dict(re.findall(r"The code for ([A-Z][a-z]+) is (\d{6})\.", context))
        restated = re.findall(r"The code for ([A-Z][a-z]+) is (\d{6})\.", echoes)
        assert 1 <= len(restated) <= 8 and len({n for n, _ in restated}) == len(restated)
        assert all(codes[n] == c for n, c in restated)
        ids, mask = tasks.encode_segments(tok, segs)
        assert ids.tolist() == tok.encode(text)  # segment boundaries are pre-tokeniser boundaries
        assert tok.decode(ids[mask == 1].tolist()) == "".join(c for _, c in restated)
    # a training-only kind: in the bucket cycle only when asked for, never among the probes
    bks = data.buckets(False, 65536)
    kinds = lambda ks: {data.bucket_for_step(s, 100, bks, False, 0.0, ks)["kind"] for s in range(40)}  # noqa: E731
    assert kinds(None) == set(tasks.KINDS) and kinds(("needle", "echo")) == {"needle", "echo"}
    assert "echo" not in tasks.KINDS


def test_arithmetic_mixes_digit_counts_by_a_fraction_and_keeps_the_end_streams():
    def short_share(mixed, n=2000, seed=6):  # share of operands below 1000: uniform 10 %, by digit count 75 %
        rng = random.Random(seed)
        ops = [int(x) for _ in range(n) for x in
               re.fullmatch(r"What is (\d+) [+-] (\d+)\?", tasks.arithmetic(rng, mixed)[0]["content"]).groups()]
        return np.mean(np.array(ops) < 1000)
    assert short_share(0.0) < 0.13 and short_share(1.0) > 0.70
    assert 0.35 < short_share(0.5) < 0.50  # (0.10 + 0.75) / 2
    # the fractions 0 and 1 draw nothing extra: the probes' and the earlier training streams stay
    for f, flag in ((0.0, False), (1.0, True)):
        r1, r2 = random.Random(3), random.Random(3)
        assert [tasks.arithmetic(r1, flag) for _ in range(50)] == [tasks.arithmetic(r2, f) for _ in range(50)]
    with pytest.raises(ValueError, match="fraction"):
        tasks.arithmetic(random.Random(0), 1.5)
    with pytest.raises(ValueError, match="arith_mixed"):
        TrainConfig("/nonexistent", 1, smoke=True, arith_mixed=-0.1)


def test_a_custom_cycle_weights_buckets_and_bad_ones_are_refused():
    bks = data.buckets(False, 65536)
    cycle = (0, 0, 2, 4)  # arithmetic on every other step
    picked = [data.bucket_for_step(s, 100, bks, False, 0.0, None, cycle) for s in range(40)]
    assert [b["kind"] for b in picked[:4]] == ["arithmetic", "arithmetic", "needle", "needle"]
    assert sum(b["kind"] == "arithmetic" for b in picked) == 20 and {b["T"] for b in picked} == {64, 1024, 4224}
    # before the curriculum ends the long-needle bucket (phase 1) is left out
    assert {b["T"] for b in (data.bucket_for_step(s, 100, bks, False, 0.5, None, cycle) for s in range(20))} == {64, 1024}
    # the longest needle bucket (past the probes' 4k-token contexts) only joins through a cycle
    assert bks[8]["kind"] == "needle" and bks[8]["T"] == 5248 and bks[8]["needle"][1] > 4000
    assert all(b["T"] <= 4224 for b in (data.bucket_for_step(s, 100, bks, False, 0.0) for s in range(40)))
    assert data.bucket_for_step(1, 100, bks, False, 0.0, None, (0, 8))["T"] == 5248
    with pytest.raises(ValueError, match="no bucket"):
        data.check_cycle((0, len(bks)), bks, None)
    with pytest.raises(ValueError, match="none of its buckets"):
        data.check_cycle((6, 7), bks, ("arithmetic",))


def test_training_arithmetic_mixes_digit_counts_probes_stay_uniform():
    rng = random.Random(4)
    ops = [int(x) for _ in range(400)
           for x in re.fullmatch(r"What is (\d+) [+-] (\d+)\?", tasks.arithmetic(rng, mixed_digits=True)[0]["content"]).groups()]
    counts = np.bincount([len(str(x)) for x in ops], minlength=5)[1:]
    assert max(ops) <= 9999 and all(c > 120 for c in counts), counts  # ~200 each of 1..4 digits
    probe_ops = [int(x) for p in tasks.probes(200, kinds=("arithmetic",))
                 for x in re.fullmatch(r"What is (\d+) [+-] (\d+)\?", p.messages[0]["content"]).groups()]
    assert np.mean([x >= 1000 for x in probe_ops]) > 0.8  # uniform over 0..9999: 90 % have 4 digits


def test_recall_exact_form():
    rng = random.Random(2)
    for _ in range(200):
        msgs = tasks.recall(rng)
        m = re.fullmatch(r"Remember: my ([a-z ]+) is (\S+)\.", msgs[0]["content"])
        assert m and msgs[1] == {"role": "assistant", "content": "OK."}
        assert msgs[-2]["content"] == f"What is my {m[1]}?" and msgs[-1]["content"] == m[2] == tasks.answer_of(msgs)
        middle = msgs[2:-2]
        assert len(middle) >= 2 and [x["role"] for x in middle] == ["user", "assistant"] * (len(middle) // 2)
        for u, a in zip(middle[::2], middle[1::2]):
            if u["content"].startswith("What is "):
                assert a["content"] == tasks.answer_of([u, a])
            else:
                assert (u["content"], a["content"]) in tasks.SMALL_TALK


def test_deterministic_per_seed_and_probes_held_out(tok):
    a = [tasks.example(k, random.Random(7), (50, 80)) for k in tasks.KINDS]
    b = [tasks.example(k, random.Random(7), (50, 80)) for k in tasks.KINDS]
    c = [tasks.example(k, random.Random(8), (50, 80)) for k in tasks.KINDS]
    assert a == b and a != c
    p1 = tasks.probes(5, needle_tokens=(100, 200), count_tokens=_count(tok))
    p2 = tasks.probes(5, needle_tokens=(100, 200), count_tokens=_count(tok))
    assert p1 == p2 and len(p1) == 15 and {p.kind for p in p1} == set(tasks.KINDS)
    for p in p1:
        assert p.messages[-1]["role"] == "user" and p.answer == tasks.answer_of(p.messages + [{"role": "assistant", "content": p.answer}])
    train_q = {m[0]["content"] for m in (tasks.arithmetic(random.Random(tasks.TRAIN_SEED * 1_000_003 + s)) for s in range(50))}
    assert not train_q & {p.messages[0]["content"] for p in p1 if p.kind == "arithmetic"}


# sha256 (first 16 hex digits) of each step's tokens + mask, steps 0-4 of seed 3 (smoke buckets of 2048 /
# 1024 tokens, 40 planned steps): what the trainer has always fed. A change to the task generators,
# the tokenizer's corpus or the bucket cycle moves them; update them only for a change meant to
# alter the training data (resumed and continued runs rely on the stream).
PINNED_SMOKE_BATCHES = {
    "default": [("arithmetic", 64, 32, "d7f3b643b672d742"), ("recall", 256, 8, "1f9baba349f7c85f"),
                ("arithmetic", 64, 32, "61f11635f5307ab3"), ("needle", 128, 16, "ff3e566886149733"),
                ("arithmetic", 64, 32, "9b45152b5a18a7c9")],
    "knobs": [("arithmetic", 64, 16, "0729657bfe6a5230"), ("recall", 256, 4, "b514fe605cf95af9"),
              ("arithmetic", 64, 16, "4bbb98418cdad256"), ("needle", 128, 8, "588825bf4d2e345c"),
              ("echo", 128, 8, "aa845efe5efa73af")],
}


def test_the_data_of_a_seed_is_pinned(tok):
    """Same seed, same data: the smoke stream's first batches, with the default data settings and
    with every data knob moved (echo, operands 1/4 by digit count, all needles with distractors)."""
    import hashlib

    settings = {"default": dict(batch_tokens=2048, kinds=None),
                "knobs": dict(batch_tokens=1024, kinds=tasks.TRAIN_KINDS, arith_mixed=0.25, needle_shared=0.5)}
    for name, kw in settings.items():
        bks = data.buckets(True, kw.pop("batch_tokens"))
        fn = partial(data.batch_for_step, tokenizer_dir=tok.source, steps=40, bks=bks, smoke=True, curriculum=0.25,
                     seed=3, **kw)
        got = []
        for step in range(5):
            bucket, (toks, mask) = fn(step)
            digest = hashlib.sha256(np.ascontiguousarray(toks).tobytes() + np.ascontiguousarray(mask).tobytes())
            got.append((bucket["kind"], bucket["T"], bucket["B"], digest.hexdigest()[:16]))
        assert got == PINNED_SMOKE_BATCHES[name], name


def test_batches_from_worker_processes_equal_in_thread_batches(tmp_path):
    """--data-workers builds the very batches the background thread builds, in step order."""
    tok_dir = str(gt_tokenizer.save(tmp_path / "tok"))
    fn = partial(data.batch_for_step, tokenizer_dir=tok_dir, steps=8, bks=data.buckets(True, 2048), smoke=True,
                 curriculum=0.25, kinds=None, seed=3)
    thread = data.Prefetcher(fn, range(2, 8), depth=2)
    procs = data.Prefetcher(fn, range(2, 8), depth=3, workers=2)
    for _ in range(2, 8):
        (s1, (b1, (t1, m1))), (s2, (b2, (t2, m2))) = thread.get(), procs.get()
        assert s1 == s2 and b1 == b2
        np.testing.assert_array_equal(t1, t2)
        np.testing.assert_array_equal(m1, m2)


def test_score():
    assert tasks.score("-512", "-512") and tasks.score("-512", " -512\n")
    assert not tasks.score("-512", "-5120") and not tasks.score("123456", "12345") and not tasks.score("OK.", "ok.")


def test_encode_mask_covers_exactly_assistant_answers(tok):
    rng = random.Random(3)
    end = tok.token_to_id("<|im_end|>")
    for kind in tasks.KINDS * 5:
        msgs = tasks.example(kind, rng, (60, 200), _count(tok))
        ids, mask = tasks.encode(tok, msgs)
        assert ids.tolist() == tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=False))
        # masked runs, in order, are exactly each assistant content followed by <|im_end|>
        runs, cur = [], []
        for i, m in zip(ids.tolist(), mask.tolist()):
            if m:
                cur.append(i)
            elif cur:
                runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        assert len(runs) == len(answers)
        for run, ans in zip(runs, answers):
            assert run[-1] == end and tok.decode(run[:-1], skip_special_tokens=False) == ans
        assert int(mask.sum()) == sum(len(tok.encode(a)) + 1 for a in answers)


# ---------------------------------------------------------------------------------------------
# Tokenizer.
# ---------------------------------------------------------------------------------------------


def test_tokenizer_specials_template_and_round_trip(tok, tmp_path):
    base = gt_tokenizer.BASE_VOCAB
    for i, s in enumerate(gt_tokenizer.SPECIAL_TOKENS):
        assert tok.token_to_id(s) == base - 3 + i and tok.encode(s) == [base - 3 + i]
    # every needle NAME is one token, wherever it stands (most are appended after the specials)
    ids = set()
    for name in tasks.NAME_POOL:
        (only,) = tok.encode(" " + name)
        assert tok.encode(f"for {name}?")[-2] == only
        ids.add(only)
    assert len(ids) == len(tasks.NAME_POOL) and max(ids) == tok.vocab_size - 1
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>")}
    msgs = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"}]
    assert tok.apply_chat_template(msgs[:1]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n")
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert rendered.endswith("<|im_start|>assistant\n3<|im_end|>\n")
    ids = tok.encode(rendered)
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3 and ids.count(tok.token_to_id("<|im_end|>")) == 3
    assert tok.decode(ids, skip_special_tokens=False) == rendered
    rng = random.Random(4)
    for kind in tasks.KINDS * 3:
        for m in tasks.example(kind, rng, (30, 60)):
            assert tok.decode(tok.encode(m["content"])) == m["content"]
    # deterministic: a second build writes the same files
    again = gt_tokenizer.save(tmp_path / "again")
    assert (again / "tokenizer.json").read_text() == (Path(tok.source) / "tokenizer.json").read_text()


# ---------------------------------------------------------------------------------------------
# Model, training, export.
# ---------------------------------------------------------------------------------------------


def _extended_shipped_vocab() -> int:
    """The vocab of the shipped default's tokenizer after ``--extend-vocab``."""
    from tokenizers import Tokenizer as RawTokenizer

    raw = RawTokenizer.from_file(str(Path(__file__).parents[2] / "weights" / "default" / "tokenizer.json"))
    return gt_tokenizer.with_single_token_names(raw).get_vocab_size()


@pytest.mark.parametrize("moe", [False, True])
def test_full_size_models_fit_budget(moe, tok):
    """Fresh (this tokenizer) or continued from the shipped export with its vocab extended."""
    for vocab in (tok.vocab_size, _extended_shipped_vocab()):
        cfg = ModelConfig.from_hf(architecture.model_config(vocab, moe_variant=moe, smoke=False))
        n = sum(int(np.prod(s)) for s in hf_shapes(cfg).values())
        assert 2 * n <= export.MAX_EXPORT_BYTES, (vocab, n)
    assert cfg.layer_types.count("linear_attention") == 3 * cfg.layer_types.count("full_attention")


def test_config_overrides_land_in_the_config_and_bad_keys_raise():
    """``train(config_overrides=...)`` / ``--config KEY=VALUE``: HF keys replace values,
    ``partial_rotary_factor`` goes into rope_parameters, ``attention_every`` rebuilds layer_types."""
    over = architecture.parse_config_overrides(["partial_rotary_factor=1.0", "attention_every=2", "hidden_size=64",
                                         "num_hidden_layers=6"])
    assert over == {"partial_rotary_factor": 1.0, "attention_every": 2, "hidden_size": 64, "num_hidden_layers": 6}
    raw = architecture.model_config(300, moe_variant=False, smoke=True, overrides=over)
    assert raw["hidden_size"] == 64 and raw["num_hidden_layers"] == 6
    assert raw["rope_parameters"]["partial_rotary_factor"] == 1.0 and raw["rope_parameters"]["rope_theta"] == 10000.0
    assert raw["layer_types"] == ["linear_attention", "full_attention"] * 3
    cfg = ModelConfig.from_hf(raw)
    assert cfg.rotary_dim == cfg.head_dim
    # the default is untouched, and a changed layer count keeps the 3:1 pattern
    assert architecture.model_config(300, moe_variant=False, smoke=True)["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert architecture.model_config(300, moe_variant=True, smoke=True, overrides={"num_hidden_layers": 8})["layer_types"] == \
        ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    for bad in ({"hiden_size": 64}, {"num_experts": 4}, {"partial_rotary_factor": 0}, {"attention_every": 0}):
        with pytest.raises(ValueError):
            architecture.model_config(300, moe_variant=False, smoke=True, overrides=bad)
    with pytest.raises(ValueError, match="unknown config override"):
        train.main(["--out", "/nonexistent/never-written", "--smoke", "--config", "no_such_key=1"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        architecture.parse_config_overrides(["partial_rotary_factor"])


def _two_layer_config(moe: bool, vocab: int = 300, **overrides) -> dict:
    """The smoke HF config cut to one GDN + one full-attention layer (compiles in half the time)."""
    raw = architecture.model_config(vocab, moe_variant=moe, smoke=True)
    return {**raw, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"], **overrides}


def _two_layer(moe: bool) -> ModelConfig:
    return ModelConfig.from_hf(_two_layer_config(moe))


def test_answer_accuracies_count_first_answer_tokens_apart():
    # two answers: tokens 2-4 and 7-8 (mask on the answer tokens); predictions right on 3, 4, 8
    tokens = jnp.arange(10)[None]
    mask = jnp.array([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0]])
    guess = np.full((1, 9), -1)
    guess[0, [2, 3, 7]] = [3, 4, 8]  # logits at t predict token t + 1
    logits = jax.nn.one_hot(jnp.asarray(np.maximum(guess, 0)), 10) * (jnp.asarray(guess) >= 0)[..., None]
    logits = logits + jax.nn.one_hot(jnp.full((1, 9), 9), 10) * 0.5 * (jnp.asarray(guess) < 0)[..., None]
    acc, first = forward.answer_accuracies(logits, tokens, mask)
    assert float(acc) == pytest.approx(3 / 5) and float(first) == 0.0  # firsts are tokens 2 and 7: both wrong


# The full-attention backends that run on the CPU: "dense", and the wrapper of the GPU-only "cudnn"
# backend (``forward.sdpa_causal_attention``) with XLA's implementation in cuDNN's place.
CPU_ATTENTION = {"dense": "dense", "sdpa": partial(forward.sdpa_causal_attention, implementation="xla")}


@pytest.mark.parametrize("attention", sorted(CPU_ATTENTION))
def test_train_logits_match_decoder_forward(attention):
    """The training forward (each full-attention backend, training delta rule) against the serving
    stack. (Dense MLP only: the MoE block is the same ``layers.moe`` call in both, and compiling it
    again would cost the CI budget.)"""
    assert set(forward.TRAIN_ATTENTION) - set(forward.GPU_ONLY_ATTENTION) == {"dense"}
    cfg = _two_layer(False)
    params = build_params(cfg, start.init_tensors(cfg, 1, init_std=0.1), jnp.asarray)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 150), 0, 300)
    ours = jax.jit(forward.train_logits, static_argnums=(1, 3, 4, 5))(params, cfg, tokens, False, "highest",
                                                                       CPU_ATTENTION[attention])
    state = decoder.init_state(cfg, 2, 192, jnp.float32)
    ref, _ = decoder.forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(150), (2, 150)), state)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=2e-4, atol=2e-4)


def test_delta_precision_only_changes_the_products_precision(tmp_path):
    """--delta-precision default: the training delta rule's products lower at the configured
    precision (TF32 on a GPU) instead of HIGHEST, with the same values on the CPU (fp32 either way)."""
    T, H, d = 70, 2, 16
    key = iter(jax.random.split(jax.random.PRNGKey(3), 5))
    q, k, v = (jax.random.normal(next(key), (T, H, d)) for _ in range(3))
    g = -jax.random.uniform(next(key), (T, H)) * 0.1
    beta = jax.random.uniform(next(key), (T, H))
    outs, texts = {}, {}
    for prec in forward.MATMUL_PRECISIONS:
        f = jax.jit(lambda *a, prec=prec: forward.delta_rule(*a, precision=prec))
        texts[prec] = f.lower(q, k, v, g, beta).as_text()
        outs[prec] = f(q, k, v, g, beta)
    assert "HIGHEST" in texts["highest"] and "HIGHEST" not in texts["default"]
    np.testing.assert_allclose(np.asarray(outs["default"]), np.asarray(outs["highest"]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="delta_precision"):
        TrainConfig(tmp_path / "x", 1, smoke=True, delta_precision="fast")
    with pytest.raises(ValueError, match="train_attention"):
        TrainConfig(tmp_path / "x", 1, smoke=True, train_attention="flash")
    if jax.default_backend() != "gpu":  # cuDNN's flash attention: refused before any work, not failed mid-run
        with pytest.raises(ValueError, match="GPU in bf16 only"):
            train.train(tmp_path / "x", 1, smoke=True, train_attention="cudnn")
        assert not (tmp_path / "x").exists()


def test_moe_export_round_trips(tmp_path, tok):
    config = architecture.model_config(tok.vocab_size, moe_variant=True, smoke=True)
    cfg = ModelConfig.from_hf(config)
    params = build_params(cfg, start.init_tensors(cfg, 2), jnp.asarray)
    out = export.export(params, config, tmp_path / "moe", Path(tok.source))
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names  # per expert, as save_pretrained writes
    loaded = load_model(out, dtype="float32", progress=False)
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), params)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded.params), rounded)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """One uninterrupted smoke run and one stopped at step 8 then resumed, same settings."""
    kw = dict(smoke=True, kinds=("arithmetic",), batch_tokens=1024, ckpt_every=4, log_every=100, log=lambda *_: None)
    base = tmp_path_factory.mktemp("smoke")
    full = train.train(base / "full", 16, profile=1, **kw)  # profiling after the last step changes nothing
    stopped = train.train(base / "resumed", 16, stop_at=8, **kw)
    # a device call's time limit: resume at 8, stop at once, export what step 8 holds
    limited = train.train(base / "resumed", 16, time_limit=0.0, **kw)
    limited_export = load_model(limited["export"], dtype="float32", progress=False).params
    resumed = train.train(base / "resumed", 16, **kw)
    return full, (stopped, limited, limited_export), resumed, base


def test_smoke_training_lowers_loss_and_resumes_exactly(smoke_runs):
    full, (stopped, limited, limited_export), resumed, base = smoke_runs
    assert full["start"] == 0 and full["last_loss"] < full["first_loss"] - 1.0, full
    assert stopped["stopped_at"] == 8 and resumed["start"] == 8
    assert limited["start"] == 8 and limited["steps"] == 8 and limited["planned_steps"] == 16
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), stopped["final_params"])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, limited_export), rounded)
    steps = sorted(int(p.name) for p in (base / "resumed" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [12, 16]  # max_to_keep=2
    jax.tree.map(np.testing.assert_array_equal, full["final_params"], resumed["final_params"])
    # --profile: one entry per bucket used (arithmetic only here); wall time only off the GPU
    assert list(full["profile"]) == ["arithmetic[16x64]"] and full["profile"]["arithmetic[16x64]"]["wall_ms"] > 0
    assert full["profile"]["arithmetic[16x64]"]["tokens"] == 1024 and resumed["profile"] is None


def test_a_tiny_config_trains_a_few_steps_and_exports_a_checkpoint_the_loader_reads(tmp_path):
    """``TrainConfig`` -> ``loop.run``: every step's loss finite and below the last, and the export
    is what ``weights.load_model`` loads (the trained params, rounded to bf16)."""
    lines: list[str] = []
    config = TrainConfig(tmp_path / "run", 4, smoke=True, kinds=("arithmetic",), batch_tokens=1024, warmup=1,
                         log_every=1, ckpt_every=4)
    summary = loop.run(config, log=lines.append)
    losses = [float(line.split(" loss ")[1].split()[0]) for line in lines if line.startswith("step ")]
    assert len(losses) == 4 and all(np.isfinite(losses)), lines
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    loaded = load_model(summary["export"], dtype="float32", progress=False)
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), summary["final_params"])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded.params), rounded)
    assert summary["steps"] == 4 and summary["safetensors_bytes"] == (tmp_path / "run/export/model.safetensors").stat().st_size


def _documented_train_commands() -> list[list[str]]:
    """The trainer arguments of every retraining command in weights/README.md: direct
    ``python -m weights.groundtruth.train`` lines, and runs of scripts/device/train_groundtruth.sh
    (its own flags + TRAIN_ARGS + each 'NAME=args' spec)."""
    root = Path(__file__).parents[2]
    script = (root / "scripts/device/train_groundtruth.sh").read_text()
    fixed = shlex.split(re.search(r"weights\.groundtruth\.train (--out .*?) \$\{TRAIN_ARGS", script, re.S)[1]
                        .replace("\\\n", " "))
    readme = (root / "weights/README.md").read_text().replace("\\\n", " ")
    commands = []
    for line in readme.splitlines():
        if line.startswith(".venv/bin/python -m weights.groundtruth.train "):
            commands.append(shlex.split(line)[3:])
        elif "train_groundtruth.sh" in line and "TRAIN_ARGS=" in line:
            words = shlex.split(line)
            at = words.index("scripts/device/train_groundtruth.sh")
            train_s = words[at + 1]
            common = shlex.split(next(w for w in words if w.startswith("TRAIN_ARGS="))[len("TRAIN_ARGS="):])
            for spec in words[at + 3:]:  # after TRAIN_S CALL_LIMIT_S
                name, args = spec.split("=", 1)
                own = [a.replace("$name", name).replace("$train_s", train_s) for a in fixed]
                commands.append(own + common + shlex.split(args))
    return commands


def test_the_documented_retraining_commands_make_valid_configs():
    """Every command weights/README.md gives for retraining parses into a TrainConfig (a renamed or
    retired flag fails here, not on a device)."""
    commands = _documented_train_commands()
    assert len(commands) == 4, commands  # smoke, dense, moe, and the device script's anneal
    configs = [train.parse_args(argv)[0] for argv in commands]
    assert [c.moe for c in configs] == [False, False, True, False] and configs[3].train_attention == "cudnn"
    assert configs[3].needle_shared == 1.0 and configs[3].cycle[:3] == (0, 4, 0) and configs[3].time_limit == 545


def test_needle_attention_diagnostic_reports_every_attention_head(smoke_runs):
    from weights.groundtruth.needle_attention import needle_attention

    full, _, _, _ = smoke_runs
    cfg = load_model(full["export"], dtype="float32", progress=False).config
    out = needle_attention(full["export"], probes=2, context=(30, 60))
    assert len(out["layers"]) == cfg.layer_types.count("full_attention") and 0 < out["uniform_target"] <= 1
    for layer in out["layers"]:
        assert len(layer["target"]) == len(layer["lines"]) == len(layer["first_digit"]) == cfg.num_heads
        for t, a, d in zip(layer["target"], layer["lines"], layer["first_digit"]):
            assert 0 <= d <= t <= a <= 1.001  # the first digit is on the target line, itself a context line


def test_evaluate_scores_every_probe_and_lists_each_miss(smoke_runs):
    """A miss list entry per wrong answer, none for right ones: right + misses = probes per kind."""
    full, _, _, _ = smoke_runs
    misses: list = []
    acc = evaluate.evaluate(full["export"], 2, needle_tokens=(30, 60), mode="pieces", max_tokens=6, misses=misses)
    for kind, r in acc.items():
        mine = [m for m in misses if m["kind"] == kind]
        assert r["n"] == 2 and r["right"] + len(mine) == 2 and r["accuracy"] == r["right"] / 2
        assert all(m["got"].strip() != m["expected"] and m["prompt_tokens"] > 0 and m["question"] for m in mine)
    assert misses, "a 16-step smoke model cannot answer every probe"
    # one kind alone: the same probes as in the full draw, so the same score and misses
    needle_misses: list = []
    only = evaluate.evaluate(full["export"], 2, needle_tokens=(30, 60), mode="pieces", max_tokens=6,
                          misses=needle_misses, kinds=("needle",))
    assert only == {"needle": acc["needle"]} and needle_misses == [m for m in misses if m["kind"] == "needle"]
    with pytest.raises(ValueError, match="no probe kind"):
        evaluate.evaluate(full["export"], 1, kinds=("echo",))


def test_init_from_an_export_starts_where_that_run_ended(smoke_runs, tmp_path):
    """--init-from: a fresh run (no checkpoints) whose params are the export's, and a model whose
    config differs is refused."""
    full, _, _, _ = smoke_runs
    kw = dict(smoke=True, kinds=("arithmetic",), batch_tokens=1024, log_every=100, log=lambda *_: None)
    # The export's own tokenizer comes along (the task corpus, hence the BPE ids, may have changed
    # since it was trained): plant a different one and check the continued run takes it.
    planted = tmp_path / "planted"
    shutil.copytree(full["export"], planted)
    # (same ids, other bytes: a tokenizer trained on another corpus has another size)
    other = tmp_path / "other_tok"
    other.mkdir()
    (other / "tokenizer.json").write_text(json.dumps(json.loads((planted / "tokenizer.json").read_text()), indent=1))
    assert (other / "tokenizer.json").read_bytes() != (planted / "tokenizer.json").read_bytes()
    shutil.copyfile(other / "tokenizer.json", planted / "tokenizer.json")
    start = train.train(tmp_path / "start", 16, init_from=planted, stop_at=0, **kw)
    assert (tmp_path / "start" / "export" / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), full["final_params"])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, start["final_params"]), rounded)
    cont = train.train(tmp_path / "cont", 2, init_from=full["export"], **kw)
    assert cont["first_loss"] < full["first_loss"] - 1.0, (cont, full)
    with pytest.raises(ValueError, match="config differs"):
        train.train(tmp_path / "wider", 2, init_from=full["export"], config_overrides={"hidden_size": 64}, **kw)


def test_dense_export_upcycles_into_the_same_function(tmp_path, tok):
    """--moe --init-from DENSE_EXPORT: the upcycled MoE model's logits are the dense model's (fp32;
    shared expert = the dense MLP, routed experts' down projections 0), and an export whose config
    differs otherwise (hidden_size, the dense MLP's width) or --extend-vocab is refused."""
    dense_config, moe_config = _two_layer_config(False, tok.vocab_size), _two_layer_config(True, tok.vocab_size)
    dense_cfg, moe_cfg = ModelConfig.from_hf(dense_config), ModelConfig.from_hf(moe_config)
    dense = build_params(dense_cfg, start.init_tensors(dense_cfg, 4, init_std=0.1), jnp.asarray)
    folder = export.export(dense, dense_config, tmp_path / "dense", Path(tok.source), dtype="float32")
    tensors = start.export_tensors(folder, moe_cfg, moe_config, seed=5)
    for i in range(len(moe_cfg.layer_types)):
        m = f"model.layers.{i}.mlp"
        assert not tensors[f"{m}.experts.down_proj"].any() and not tensors[f"{m}.shared_expert_gate.weight"].any()
        assert tensors[f"{m}.experts.gate_up_proj"].std() > 0.01 and tensors[f"{m}.gate.weight"].std() > 0.01
    upcycled = build_params(moe_cfg, tensors, jnp.asarray)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, tok.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(40), (2, 40))
    want, _ = decoder.forward(dense, dense_cfg, tokens, pos, decoder.init_state(dense_cfg, 2, 64, jnp.float32))
    got, _ = decoder.forward(upcycled, moe_cfg, tokens, pos, decoder.init_state(moe_cfg, 2, 64, jnp.float32))
    assert float(jnp.abs(want).max()) > 0.1  # the MLPs matter: the comparison is not trivially equal
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for bad, match in (({"hidden_size": 64}, "config differs"), ({"shared_expert_intermediate_size": 32}, "intermediate_size")):
        config = _two_layer_config(True, tok.vocab_size, **bad)
        with pytest.raises(ValueError, match=match):
            start.export_tensors(folder, ModelConfig.from_hf(config), config)
    with pytest.raises(ValueError, match="extend-vocab"):
        start.export_tensors(folder, moe_cfg, moe_config, tok)


def test_extend_vocab_keeps_every_id_and_adds_one_token_per_name(tmp_path):
    """--init-from EXPORT --extend-vocab on an export whose tokenizer splits names (the earliest
    exports): ids and embedding rows kept, each name one new token whose row starts as the mean of
    its old pieces' rows. A fresh run has the name tokens already: extending it is refused."""
    kw = dict(smoke=True, kinds=("arithmetic",), batch_tokens=1024, log_every=100, log=lambda *_: None)
    base_dir = tmp_path / "base_tok"
    gt_tokenizer.save(base_dir, tokenizer=gt_tokenizer.build_base())
    old_tok = Tokenizer.from_dir(base_dir)
    config = architecture.model_config(old_tok.vocab_size, moe_variant=False, smoke=True)
    cfg = ModelConfig.from_hf(config)
    params = build_params(cfg, start.init_tensors(cfg, 3), lambda x: jnp.asarray(x, jnp.float32))
    old_export = export.export(params, config, tmp_path / "old", base_dir)
    run = train.train(tmp_path / "ext", 4, init_from=old_export, extend_vocab=True, stop_at=0, **kw)
    new_tok = Tokenizer.from_dir(tmp_path / "ext" / "export")
    old_embed = np.asarray(load_model(old_export, dtype="float32", progress=False).params["embed"])
    embed = np.asarray(run["final_params"]["embed"])
    assert embed.shape[0] == new_tok.vocab_size > old_tok.vocab_size
    np.testing.assert_array_equal(embed[: old_tok.vocab_size], old_embed)
    rng = random.Random(5)
    for kind in tasks.KINDS:  # text without names tokenises as before
        for m in tasks.example(kind, rng, (30, 60)):
            if kind != "needle":
                assert new_tok.encode(m["content"]) == old_tok.encode(m["content"])
    name = tasks.NAME_POOL[17]
    (nid,) = new_tok.encode(" " + name)
    np.testing.assert_allclose(embed[nid], old_embed[old_tok.encode(" " + name)].mean(0), rtol=1e-6)
    with pytest.raises(ValueError, match="extend_vocab"):
        train.train(tmp_path / "refused", 2, extend_vocab=True, **kw)


def test_smoke_export_is_exact_and_transformers_shaped(smoke_runs, oracle_dir):
    full, _, _, _ = smoke_runs
    out = Path(full["export"])
    loaded = load_model(out, dtype="float32", progress=False)  # raises on any unexpected tensor
    cfg = loaded.config
    rounded = jax.tree.map(lambda x: jnp.asarray(np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)),
                           full["final_params"])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded.params),
                 jax.tree.map(np.asarray, rounded))
    tokens = jnp.asarray([Tokenizer.from_dir(out).encode("<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n")], jnp.int32)
    T = tokens.shape[1]
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    a, _ = decoder.forward(loaded.params, cfg, tokens, pos, decoder.init_state(cfg, 1, 64, jnp.float32))
    b, _ = decoder.forward(rounded, cfg, tokens, pos, decoder.init_state(cfg, 1, 64, jnp.float32))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # config.json: every key transformers' save_pretrained writes for a qwen3_5_text model, same types
    # (transformers loading the shipped export is tests/models/test_differential.py's "default" case)
    ours = json.loads((out / "config.json").read_text())
    ref = json.loads((oracle_dir / "qwen3_5-dense" / "config.json").read_text())
    assert set(ref) <= set(ours), set(ref) - set(ours)
    for k, v in ref.items():
        assert type(ours[k]) is type(v) or v is None or ours[k] is None, k
    assert ours["model_type"] == "qwen3_5_text" and ours["architectures"] == ["Qwen3_5ForCausalLM"]
    im_end = Tokenizer.from_dir(out).token_to_id("<|im_end|>")
    assert ours["dtype"] == "bfloat16" and ours["eos_token_id"] == im_end
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == ours["eos_token_id"] and gen["do_sample"] is False
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / f).is_file()


def test_greedy_pieces_equals_generate():
    from jaxserve.generate import generate
    from jaxserve.sampling_params import SamplingParams

    cfg = _two_layer(False)
    params = build_params(cfg, start.init_tensors(cfg, 3, init_std=0.3), jnp.asarray)
    ids = np.random.default_rng(0).integers(0, 297, 33).tolist()  # prefilled as pieces of 32 and 1
    ref = generate(params, cfg, ids, SamplingParams(max_tokens=8), eos_token_ids=(299,))
    got = evaluate.greedy_pieces(params, cfg, ids, 8, (299,), 256)
    assert got == ref.output_ids and len(set(got)) > 1
