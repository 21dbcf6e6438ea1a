"""The translator: data, batching, models, decoding, checkpoints, resume, AER mapping.

Small and fast: tiny models on a handful of pairs. The end-to-end command-line tests and the
distributed test are in test_translate_cli.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from attnlab.data import Alignment, Pair  # noqa: E402
from attnlab.translate import checkpoint as ckpt  # noqa: E402
from attnlab.translate.batching import collate, encode_pairs, epoch_batches, shard  # noqa: E402
from attnlab.translate.decoding import beam_search, greedy  # noqa: E402
from attnlab.translate.metrics import alignment_scores, token_to_word, word_attention  # noqa: E402
from attnlab.translate.models import build_model, model_config  # noqa: E402
from attnlab.translate.rnn import RNN_ATTENTIONS  # noqa: E402
from attnlab.translate.tokenizer import BOS, EOS, Tokenizer  # noqa: E402
from attnlab.translate.trainer import TrainOptions, fit  # noqa: E402

ALL_VARIANTS = [("rnn", a) for a in RNN_ATTENTIONS] + [
    ("transformer", "multihead"),
    ("transformer", "gqa"),
]

PAIRS = [
    Pair("one two three", "uno dos tres", "p0"),
    Pair("three two one", "tres dos uno", "p1"),
    Pair("two one", "dos uno", "p2"),
    Pair("one one three", "uno uno tres", "p3"),
    Pair("three", "tres", "p4"),
    Pair("two three two", "dos tres dos", "p5"),
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def char_tok():
    return Tokenizer.train([p.source for p in PAIRS] + [p.target for p in PAIRS], "char")


def random_batch(V=40, B=3, S=7, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (B, S), generator=g)
    lengths = torch.tensor([S, S - 2, 3][:B])
    for b in range(B):
        src[b, lengths[b] :] = 0
    tgt = torch.randint(4, V, (B, T), generator=g)
    tgt[:, 0] = BOS
    return src, lengths, tgt


# ------------------------------------------------------------------------------ data
def test_bible_task_splits_are_fixed_and_disjoint():
    from attnlab.translate.tasks import load_task

    a, b = load_task({"name": "bible"}), load_task({"name": "bible"})
    assert (len(a.train), len(a.validation), len(a.test)) == (28890, 1000, 1000)
    assert [p.id for p in a.test] == [p.id for p in b.test]
    ids = [{p.id for p in s} for s in (a.train, a.validation, a.test)]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    assert set(a.alignments["test"]) == ids[2]
    # the texts the Bible repeats across splits, as attnlab.data.bible's docstring counts them
    seen = {p.source for p in a.train}
    pairs = {(p.source, p.target) for p in a.train}
    for split, sources, both in ((a.test, 13, 5), (a.validation, 14, 13)):
        assert sum(p.source in seen for p in split) == sources
        assert sum((p.source, p.target) in pairs for p in split) == both


def test_dates_task_is_deterministic():
    pytest.importorskip("babel")
    from attnlab.translate.tasks import load_task

    a = load_task({"name": "dates", "train_size": 300})
    b = load_task({"name": "dates", "train_size": 300})
    assert a.train == b.train and a.test == b.test and a.tokenizer == "char"
    assert not {p.target for p in a.train} & {p.target for p in a.test}


def test_dates_reference_alignments_link_digits_to_the_words_that_state_them():
    pytest.importorskip("babel")
    from attnlab.translate.tasks import dates_alignments

    pairs = [
        Pair("Wednesday, 6 March 1946", "1946-03-06", "1946-03-06/en_GB/full"),
        Pair("26.11.1942", "1942-11-26", "1942-11-26/es_ES/dots"),
        Pair("10 de febrero de 1952", "1952-02-10", "1952-02-10/es_ES/long"),
        Pair("So. 6 Apr. 1919", "1919-04-06", "1919-04-06/de_DE/wdmy"),
        # martes and marzo are both "mar": the month's digits were linked to the weekday
        Pair("mar 24 mar 2037", "2037-03-24", "2037-03-24/es_ES/wdmy"),
    ]
    refs = dates_alignments(pairs)
    assert "2037-03-24/es_ES/wdmy" not in refs  # ambiguous: no reference, as promised

    def expect(y, m, d):
        return {(y, 0), (y, 1), (y, 2), (y, 3), (m, 5), (m, 6), (d, 8), (d, 9)}

    assert refs["1946-03-06/en_GB/full"].sure == expect(4, 3, 2)
    assert refs["1942-11-26/es_ES/dots"].sure == expect(4, 2, 0)
    assert refs["1952-02-10/es_ES/long"].sure == expect(4, 2, 0)
    assert refs["1919-04-06/de_DE/wdmy"].sure == expect(5, 3, 2)  # ['So', '.', '6', 'Apr', ...]
    from attnlab.data import load_dates

    assert len(dates_alignments(load_dates("test", 300))) == 300  # every pair gets a reference


def test_tsv_task_split_by_source_hash(tmp_path):
    from attnlab.translate.tasks import load_task

    path = tmp_path / "pairs.tsv"
    lines = [f"sentence {i}\tfrase {i}" for i in range(200)] + ["sentence 7\tfrase siete"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    t1 = load_task({"name": "tsv", "path": str(path)})
    t2 = load_task({"name": "tsv", "path": str(path)})
    assert t1.test == t2.test and t1.train == t2.train
    assert len(t1.test) == len(t1.validation) == 10
    held = {p.source for p in t1.test + t1.validation}
    assert not held & {p.source for p in t1.train}  # a repeated source never straddles splits


def test_bpe_tokenizer_roundtrip_and_spans(tmp_path):
    texts = [
        "In the beginning God created the heaven and the earth.",
        "EN el principio crió Dios los cielos y la tierra.",
        "¿Quién es? Él, señor.",
    ] * 20
    tok = Tokenizer.train(texts, "bpe", vocab_size=300)
    tok.save(tmp_path / "tok.json")
    again = Tokenizer.load(tmp_path / "tok.json")
    for text in texts[:3]:
        ids, spans = again.encode(text)
        assert again.decode(ids) == text  # byte-level BPE: exact detokenization
        assert all(0 <= a <= b <= len(text) for a, b in spans)
        assert (token_to_word(spans, text) >= 0).all()  # every piece belongs to a word
    assert again.vocab_size == tok.vocab_size


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_special_token_spellings_in_a_sentence_are_text(kind, tmp_path):
    """BPE matched "<s>", "</s>", "<pad>", "<unk>" in the text as the special ids: an EOS in the
    middle of a target ("<s>" is HTML's strikethrough) and a PAD the loss skips."""
    texts = ["the price was <s>10</s> 8 dollars", "use <pad> and <unk> here", "hello"] * 5
    tok = Tokenizer.train(texts, kind, vocab_size=300)
    tok.save(tmp_path / "tok.json")
    for t in (tok, Tokenizer.load(tmp_path / "tok.json")):
        for text in texts[:2]:
            ids, _ = t.encode(text)
            assert min(ids) >= 4, ids  # no special id (0-3) inside the text
            assert t.decode(ids) == text


def test_char_tokenizer_roundtrip(tmp_path, char_tok):
    char_tok.save(tmp_path / "t.json")
    tok = Tokenizer.load(tmp_path / "t.json")
    ids, spans = tok.encode("dos uno")
    assert tok.decode(ids) == "dos uno" and spans[0] == (0, 1) and len(ids) == 7
    assert tok.encode("dos ñ")[0][-1] == 3  # unknown character -> UNK


def test_char_tokenizer_reads_every_whitespace_as_a_space(tmp_path):
    """Before: every whitespace but " " was dropped in encoding (and yet given an id in
    training), so words joined by a no-break space or a tab came back glued ("3juin2001")."""
    texts = ["10 mai 1999", "3\u00a0juin\t2001", "5\u3000mars\n2000"]
    tok = Tokenizer.train(texts, "char")
    assert not [s for s in tok.token_strings(range(4, tok.vocab_size)) if s.isspace() and s != " "]
    tok.save(tmp_path / "t.json")
    for t in (tok, Tokenizer.load(tmp_path / "t.json")):
        for text in [*texts, "5\u2009mai\u202f1999"]:  # thin spaces: never seen in training
            ids, spans = t.encode(text)
            assert 3 not in ids  # no UNK
            assert spans == [(i, i + 1) for i in range(len(text))]  # one token per character
            assert t.decode(ids) == " ".join(text.split())


def test_epoch_batches_deterministic_cover_and_shard(char_tok):
    data, _ = encode_pairs(char_tok, PAIRS * 20)
    b1 = epoch_batches(data, seed=3, epoch=2, max_tokens=64)
    b2 = epoch_batches(data, seed=3, epoch=2, max_tokens=64)
    b3 = epoch_batches(data, seed=3, epoch=3, max_tokens=64)
    assert b1 == b2 and b1 != b3
    assert sorted(i for b in b1 for i in b) == list(range(len(data)))  # every pair once
    for b in b1:  # the token budget holds (padding included)
        longest = max(max(len(data.src[i]), len(data.tgt[i])) + 1 for i in b)
        assert longest * len(b) <= 64 or len(b) == 1
    batch = collate(data, b1[0])
    assert (batch.tgt_in[:, 0] == BOS).all() and (batch.tgt_out == EOS).sum() == len(b1[0])
    parts = [shard(b1[0], r, 2) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(b1[0])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_pair_is_in_one_batch_for_any_number_of_processes(char_tok, world):
    """A pool's last batch with fewer sentences than processes was dropped: with 4 processes
    3 of 500 pairs were never trained on, in every epoch."""
    data, _ = encode_pairs(char_tok, PAIRS * 20 + PAIRS[:1])
    for epoch in range(3):
        batches = epoch_batches(data, seed=3, epoch=epoch, max_tokens=40 * world,
                                pool=2, min_sentences=world)  # fmt: skip
        assert sorted(i for b in batches for i in b) == list(range(len(data)))
        assert min(len(b) for b in batches) >= world


# ------------------------------------------------------------------------------ models
@pytest.mark.parametrize("kind,attention", ALL_VARIANTS)
def test_step_by_step_decoding_matches_teacher_forcing(kind, attention):
    """Cached / incremental decoding gives the logits of the full forward pass (within 1e-5)."""
    torch.manual_seed(0)
    model = build_model(model_config(kind, attention, "tiny"), 40).eval()
    src, lengths, tgt = random_batch()
    with torch.no_grad():
        full = model(src, lengths, tgt)
        state = model.start(model.encode(src, lengths))
        steps = []
        for t in range(tgt.shape[1]):
            logits, state, _ = model.step(tgt[:, t], state)
            steps.append(logits)
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind,attention", ALL_VARIANTS)
def test_every_model_trains_a_step_under_bf16_autocast(kind, attention):
    """--precision bf16 runs the forward under torch.autocast: "luong-concat" (a crash in its
    scores' matmul) and "hard" (its dtype check refused autocast's bf16 query) failed there."""
    torch.manual_seed(0)
    model = build_model(model_config(kind, attention, "tiny"), 40).eval()  # (no dropout)
    src, lengths, tgt = random_batch()
    with torch.no_grad():
        want = model(src, lengths, tgt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, lengths, tgt)
    logits.float().sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.isfinite().all() for g in grads)
    assert (logits.float() - want).abs().max() < 0.1 * want.abs().max()  # bf16-near, not garbage


def test_transformer_kv_cache_matches_uncached_prefixes():
    """Decoding with the KV cache = recomputing the whole prefix without a cache, every step."""
    torch.manual_seed(1)
    model = build_model(model_config("transformer", "gqa", "tiny", heads=4, kv_heads=2), 40).eval()
    src, lengths, tgt = random_batch(seed=1)
    with torch.no_grad():
        state = model.start(model.encode(src, lengths))
        for t in range(tgt.shape[1]):
            cached, state, _ = model.step(tgt[:, t], state)
            uncached = model(src, lengths, tgt[:, : t + 1])[:, -1]
            torch.testing.assert_close(cached, uncached, atol=1e-5, rtol=0)
        assert state["cache"].get_seq_length(0) == tgt.shape[1]


@pytest.mark.parametrize("kind,attention", ALL_VARIANTS)
def test_beam_one_equals_greedy(kind, attention):
    torch.manual_seed(2)
    model = build_model(model_config(kind, attention, "tiny"), 40).eval()
    src, lengths, _ = random_batch(seed=2)
    g = greedy(model, src, lengths, return_attention=True)
    b = beam_search(model, src, lengths, beam_size=1, return_attention=True)
    assert [h.tokens for h in g] == [h.tokens for h in b]
    if g[0].attention is not None:
        for x, y in zip(g, b, strict=True):
            torch.testing.assert_close(x.attention, y.attention)


def test_attention_maps_shapes_and_masking():
    src, lengths, tgt = random_batch()
    rnn = build_model(model_config("rnn", "bahdanau", "tiny"), 40).eval()
    tr = build_model(model_config("transformer", "multihead", "tiny", heads=2), 40).eval()
    with torch.no_grad():
        _, a = rnn(src, lengths, tgt, return_attention=True)
        _, b = tr(src, lengths, tgt, return_attention=True)
    assert a.shape == (3, 6, 7) and b.shape == (3, 1, 2, 6, 7)
    for w in (a, b):
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
        assert w[2, ..., 3:].abs().max() == 0  # padded source positions get exactly 0
    hyps = beam_search(tr, src, lengths, beam_size=3, return_attention=True)
    for h, L in zip(hyps, lengths.tolist(), strict=True):
        T = len(h.tokens) + int(h.eos)
        assert h.attention.shape == (1, 2, T, 7)
        assert h.attention[..., L:].abs().sum() == 0


def test_beam_search_finds_at_least_greedy_score():
    torch.manual_seed(3)
    model = build_model(model_config("rnn", "luong-general", "tiny"), 40).eval()
    src, lengths, _ = random_batch(seed=3)

    def logp(hyp, b):
        """Teacher-forced log-probability of a hypothesis (and of its EOS, if it ended so)."""
        seq = [BOS] + hyp.tokens + ([EOS] if hyp.eos else [])
        with torch.no_grad():
            out = torch.log_softmax(
                model(src[b : b + 1], lengths[b : b + 1], torch.tensor([seq[:-1]])), -1
            )[0]
        return float(out[torch.arange(len(seq) - 1), torch.tensor(seq[1:])].sum())

    g = greedy(model, src, lengths)
    b = beam_search(model, src, lengths, beam_size=5, length_penalty=0.0)
    for i in range(3):
        # the scores the decoders report are the model's log-probabilities of what they chose
        assert g[i].score == pytest.approx(logp(g[i], i), abs=1e-4)
        assert b[i].score == pytest.approx(logp(b[i], i), abs=1e-4)
        assert b[i].score >= g[i].score - 1e-4
    # with the GNMT penalty: log p / lp(n), n the scored tokens (EOS counts where it ended one;
    # before, a hypothesis cut at the length limit was divided by lp(n + 1), a step of reward
    # it had not scored)
    alpha = 0.6
    b = beam_search(model, src, lengths, beam_size=5, length_penalty=alpha)
    assert not all(h.eos for h in b)  # (a cut one is checked)
    for i in range(3):
        n = len(b[i].tokens) + b[i].eos
        assert b[i].score == pytest.approx(logp(b[i], i) / ((5 + n) / 6) ** alpha, abs=1e-4)


# ------------------------------------------------------------------------------ training
def _tiny_opts(**kw):
    base = {
        "lr": 3e-3,
        "warmup": 10,
        "max_tokens": 256,
        "label_smoothing": 0.0,
        "seed": 5,
        "eval_every": 0.5,
        "checkpoint_seconds": 1e9,
    }
    base.update(kw)
    return TrainOptions.from_dict(base)


@pytest.mark.parametrize("kind,attention", [("rnn", "bahdanau"), ("transformer", "multihead")])
def test_tiny_model_overfits_a_handful_of_pairs(tmp_path, char_tok, kind, attention):
    data, _ = encode_pairs(char_tok, PAIRS)
    torch.manual_seed(0)
    cfg = model_config(kind, attention, "tiny")
    model = build_model(cfg, char_tok.vocab_size)
    fit(
        model,
        data,
        data,
        _tiny_opts(
            max_steps=80 if kind == "rnn" else 150, lr=1e-2, min_lr_ratio=0.1, eval_every=2.0
        ),
        tmp_path,
        progress_bar=False,
    )
    model.eval()
    from attnlab.translate.batching import source_tensor

    src, lengths = source_tensor(data.src)
    hyps = greedy(model, src, lengths)
    assert [char_tok.decode(h.tokens) for h in hyps] == [p.target for p in PAIRS]


def test_resume_is_bit_identical_to_uninterrupted(tmp_path, char_tok):
    """Interrupt after 7 steps, resume, finish: same parameters as one uninterrupted run."""
    data, _ = encode_pairs(char_tok, PAIRS * 4)
    cfg = model_config("transformer", "multihead", "tiny", dropout=0.2)  # dropout: RNG matters

    def new_model():
        torch.manual_seed(0)
        return build_model(cfg, char_tok.vocab_size)

    opts = _tiny_opts(epochs=3.0, max_tokens=64)
    straight = new_model()
    fit(straight, data, data, opts, tmp_path / "a", progress_bar=False)

    first = new_model()
    s1 = fit(first, data, data, opts, tmp_path / "b", progress_bar=False, stop_at_step=7)
    assert s1.interrupted and s1.step == 7
    torch.manual_seed(12345)  # the resumed process starts with other RNG states
    resumed = new_model()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # and other weights: all must come from the checkpoint
    s2 = fit(resumed, data, data, opts, tmp_path / "b", resume=True, progress_bar=False)
    assert s2.step > 7 and not s2.interrupted
    for (name, a), (_, b) in zip(
        straight.state_dict().items(), resumed.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_every_checkpoint_records_the_exact_epochs_done(tmp_path, char_tok):
    """A periodic checkpoint (a kill -9 after it) kept epochs_done of the session's end only,
    so --more-epochs 1 after 13 of 14 batches added 1 step: whole epochs were counted."""
    from attnlab.translate.cmd_train import done_so_far

    data, _ = encode_pairs(char_tok, PAIRS * 4)
    torch.manual_seed(0)
    model = build_model(model_config("rnn", "bahdanau", "tiny"), char_tok.vocab_size)
    opts = _tiny_opts(epochs=3.0, max_tokens=64, checkpoint_seconds=1e-9)  # every step
    state = fit(model, data, data, opts, tmp_path, progress_bar=False, stop_at_step=5)
    saved = ckpt.read_checkpoint_state(ckpt.latest_checkpoint(tmp_path))
    assert saved["step"] == 5 and 0 < saved["epochs_done"] == state.epochs_done
    old = dict(saved, epochs_done=0.0, history=[])  # an older run's periodic checkpoint
    assert done_so_far(saved)["epochs"] == saved["epochs_done"]
    assert done_so_far(old)["epochs"] == saved["epoch"]  # (whole epochs: all it can know)


@pytest.fixture
def ctrl_c_in_step_3(monkeypatch):
    """``ctrl_c_in_step_3(handler)``: SIGINT's handler set to ``handler`` (put back after the
    test: pytest run in a shell's background starts with SIGINT ignored), and a SIGINT raised
    in the middle of training step 3 (its batch's collate); returns the collate calls seen,
    each with the handler then in place."""
    import signal

    from attnlab.translate import trainer

    before, seen = signal.getsignal(signal.SIGINT), []
    real_collate = trainer.collate

    def collate_with_ctrl_c(*args, **kwargs):
        seen.append(signal.getsignal(signal.SIGINT))
        if len(seen) == 3:
            signal.raise_signal(signal.SIGINT)
        return real_collate(*args, **kwargs)

    def arm(handler):
        signal.signal(signal.SIGINT, handler)
        monkeypatch.setattr(trainer, "collate", collate_with_ctrl_c)
        return seen

    yield arm
    signal.signal(signal.SIGINT, before)


def _fit_tiny(char_tok, tmp_path, epochs):
    data, _ = encode_pairs(char_tok, PAIRS * 4)
    model = build_model(model_config("rnn", "luong-dot", "tiny"), char_tok.vocab_size)
    opts = _tiny_opts(epochs=epochs, max_tokens=64)
    return fit(model, data, data, opts, tmp_path, progress_bar=False)


def test_ctrl_c_finishes_the_step_saves_and_stops(tmp_path, char_tok, ctrl_c_in_step_3):
    import signal

    ctrl_c_in_step_3(signal.default_int_handler)  # (as in a terminal)
    state = _fit_tiny(char_tok, tmp_path, epochs=5.0)
    assert state.interrupted and state.step == 3  # step 3 completed, nothing after it
    saved = ckpt.latest_checkpoint(tmp_path)
    assert saved is not None and saved.name == "step-00000003"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored


def test_a_sigint_the_process_ignores_stays_ignored(tmp_path, char_tok, ctrl_c_in_step_3):
    """Started ignoring SIGINT (nohup, a shell's background job), training keeps ignoring it:
    a Ctrl-C meant for the shell in front neither stops it nor changes its handler."""
    import signal

    seen = ctrl_c_in_step_3(signal.SIG_IGN)
    state = _fit_tiny(char_tok, tmp_path, epochs=1.0)
    assert not state.interrupted and len(seen) > 3
    assert set(seen) == {signal.SIG_IGN}
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_checkpoint_round_trip_and_atomicity(tmp_path, char_tok, monkeypatch):
    model = build_model(model_config("rnn", "luong-concat", "tiny"), char_tok.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*random_batch(V=char_tok.vocab_size)).sum().backward()
    opt.step()
    ckpt.save_checkpoint(tmp_path, 1, model, opt, {"step": 1, "epoch": 0})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    exp_opt = opt.state_dict()

    # A crash while writing the next checkpoint leaves the previous one in place.
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "atomic_write_json", boom)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path, 2, model, opt, {"step": 2})
    monkeypatch.undo()
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.name == "step-00000001"
    assert not list((tmp_path / ckpt.CHECKPOINTS).glob(".step-*"))  # no half-written folder

    other = build_model(model_config("rnn", "luong-concat", "tiny"), char_tok.vocab_size)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    state = ckpt.load_checkpoint(latest, other, other_opt)
    assert state["step"] == 1
    for k, v in other.state_dict().items():
        assert torch.equal(v, expected[k]), k
    got = other_opt.state_dict()
    for idx, st in exp_opt["state"].items():
        for name, value in st.items():
            assert torch.equal(torch.as_tensor(got["state"][idx][name]), torch.as_tensor(value))


def test_tied_weights_saved_once(tmp_path):
    model = build_model(model_config("transformer", "multihead", "tiny"), 30)
    state = ckpt.model_state(model)
    assert "out.weight" not in state and "embedding.weight" in state
    ckpt.save_tensors(tmp_path / "m.safetensors", state)
    again = build_model(model_config("transformer", "multihead", "tiny"), 30)
    ckpt.load_model_state(again, ckpt.load_tensors(tmp_path / "m.safetensors"))
    assert again.out.weight is again.embedding.weight
    assert torch.equal(again.out.weight, model.out.weight)


# ------------------------------------------------------------------------------ AER mapping
def test_subword_attention_to_word_alignment():
    source = "the LORD's house"
    target = "la casa"
    src_spans = [(0, 3), (4, 8), (8, 10), (11, 16)]  # the | LORD | 's | house (+ EOS column)
    tgt_spans = [(0, 2), (3, 5), (5, 7)]  # la | ca | sa (+ EOS row)
    assert token_to_word(src_spans, source).tolist() == [0, 1, 1, 2]
    assert token_to_word(tgt_spans, target).tolist() == [0, 1, 1]
    attn = np.array(
        [  # rows: la, ca, sa, </s>; columns: the, LORD, 's, house, </s>
            [0.7, 0.1, 0.1, 0.1, 0.0],
            [0.0, 0.1, 0.1, 0.8, 0.0],
            [0.0, 0.3, 0.3, 0.4, 0.0],
            [0.0, 0.0, 0.0, 0.0, 1.0],
        ]
    )
    W = word_attention(
        attn, token_to_word(src_spans, source), token_to_word(tgt_spans, target), 3, 2
    )
    np.testing.assert_allclose(W, [[0.7, 0.2, 0.1], [0.0, 0.4, 0.6]])  # sum src, average tgt
    ref = {"s": Alignment(frozenset({(0, 0), (2, 1)}), frozenset({(0, 0), (2, 1)}))}
    assert alignment_scores({"s": {(0, 0), (2, 1)}}, ref) == {"aer": 0.0, "aer_referenced": 0.0}
    assert alignment_scores({"s": {(1, 0), (2, 1)}}, ref)["aer"] == 50.0


def test_the_reported_best_head_is_chosen_on_validation_and_a_limit_is_said(tmp_path, capsys):
    # before: the head with the lowest test AER was reported as the test figure (a best-of-N
    # on test), and --eval-limit N printed "N pairs" as if that were the whole split
    from attnlab import cli
    from attnlab.translate import load_run
    from attnlab.translate.batching import fixed_sample
    from attnlab.translate.evaluation import HEAD_SELECTION_PAIRS, alignment_error
    from attnlab.translate.tasks import run_task

    out = tmp_path / "run"
    argv = ["train", "--task", "dates", "--tiny", "--model", "transformer", "--max-steps", "2",
            "--train-size", "100", "--eval-limit", "7", "--no-progress",
            "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())["test"]
    task = run_task(out, json.loads((out / "config.json").read_text())["task"])
    assert results["sentences"] == 7 and results["of"] == len(task.test)
    assert f"first 7 of {len(task.test):,} pairs" in printed
    al = results["alignment"]
    sample = fixed_sample(len(task.validation), HEAD_SELECTION_PAIRS)
    chosen = [task.validation[i] for i in sample]
    on_validation = alignment_error(
        load_run(out), chosen, task.alignments["validation"], target_units="chars",
        progress=False,
    )["heads"]  # fmt: skip
    best = min(on_validation, key=lambda k: on_validation[k]["aer_referenced"])
    assert al["best_head"]["head"] == best
    assert al["best_head"]["chosen_on"] == f"validation ({len(chosen):,} pairs)"
    assert al["best_head"]["aer_referenced"] == al["heads"][best]["aer_referenced"]
    assert f"best head {best} (chosen on validation" in printed


def test_kv_heads_given_are_the_kv_heads_built():
    # before: --attention gqa --kv-heads K took heads // 2 whenever K equalled the preset's
    from attnlab.translate.models import model_config

    assert model_config("transformer", "gqa", "small", heads=4, kv_heads=1)["kv_heads"] == 1
    assert model_config("transformer", "gqa", "small", heads=8)["kv_heads"] == 4  # the default
    alone = model_config("transformer", None, "small", heads=4, kv_heads=2)  # asks for gqa
    assert (alone["attention"], alone["kv_heads"]) == ("gqa", 2)


def test_bleu_tokenizes_unspaced_scripts_as_sacrebleu_does_for_their_language():
    # from a review: 13a always, so a near-perfect Chinese translation scored BLEU 0.0
    import sacrebleu

    from attnlab.translate.metrics import bleu_chrf, bleu_tokenizer

    refs = ["我们明天去北京看长城。", "他每天早上喝一杯咖啡。", "这本书非常有意思。"]
    hyps = ["我们明天去北京看长城。", "他每天早上喝咖啡。", "这本书很有意思。"]
    got = bleu_chrf(hyps, refs)
    want = sacrebleu.BLEU(tokenize="zh").corpus_score(hyps, [refs]).score
    assert got["bleu"] == round(want, 2) > 40 and "tok:zh" in got["bleu_signature"]
    assert bleu_tokenizer(["明日は東京へ行きます。"]) == "char"  # kana: Japanese
    assert bleu_tokenizer(["ฉันไปตลาดทุกวัน"]) == "char"  # Thai
    assert bleu_tokenizer(["Der Hund schläft.", "나는 학교에 간다."]) == "13a"  # spaced scripts
    latin = bleu_chrf(["the cat sat"], ["the cat sat down"])
    assert "tok:13a" in latin["bleu_signature"]
