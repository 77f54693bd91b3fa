"""kvh_cache.model without the real model: the GGUF parser and dequantiser
against the `gguf` package, the BPE tokenizer, and the forward pass of a
tiny random Llama GGUF through kvh versus the NumPy reference."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("gguf", reason="kvh_cache.model needs the gguf package (pip install gguf)")
pytest.importorskip("regex", reason="kvh_cache.model's tokenizer needs the regex package (pip install regex)")

import kvh_cache.model as km  # noqa: E402
from kvh_cache.model import runner as runner_mod  # noqa: E402
from kvh_cache.model.testing import write_tiny_llama  # noqa: E402

QTYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_1"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_gguf")


@pytest.fixture(scope="module")
def tiny_path(tiny_dir):
    return write_tiny_llama(str(tiny_dir / "tiny.gguf"), qtype="Q4_1", seed=1)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return km.load(tiny_path, cache=False)


# ---------------------------------------------------------------------------------
# GGUF parsing and dequantisation
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", QTYPES)
def test_parser_matches_gguf_reader(tiny_dir, qtype):
    import gguf

    p = write_tiny_llama(str(tiny_dir / f"t_{qtype}.gguf"), qtype=qtype, tied=qtype != "F16", seed=2)
    ref = gguf.GGUFReader(p)
    with km.GGUFFile(p) as g:
        assert set(g.tensors) == {t.name for t in ref.tensors}
        for t in ref.tensors:
            info = g.tensors[t.name]
            assert info.type_name == t.tensor_type.name
            assert info.shape == tuple(int(x) for x in reversed(t.shape))
            want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(info.shape)
            np.testing.assert_array_equal(g.tensor(t.name), want)
        for key, field in ref.fields.items():
            if key.startswith("GGUF."):
                continue
            want = field.contents()
            got = g.metadata[key]
            if isinstance(got, np.ndarray):
                got = got.tolist()
            if isinstance(want, float):
                assert got == pytest.approx(want)
            else:
                assert got == want, key
        cfg = km.load_config(g)
        assert cfg.tied_output == (qtype != "F16")
        assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (2, 64, 4, 2, 16)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_fast_dequantize_is_bit_exact(qtype):
    import gguf

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 256)) * rng.uniform(0.01, 10, (8, 1))).astype(np.float32)
    qt = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(x, qt)
    got = km.dequantize(raw, qtype)
    want = gguf.quants.dequantize(raw, qt)
    np.testing.assert_array_equal(got, want)
    assert got.shape == x.shape


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        km.GGUFFile(str(p))


@pytest.mark.parametrize("cut", [8, 24, 60, 200, -1])
def test_cut_or_damaged_gguf_is_a_value_error_naming_the_file(cut, tiny_path, tmp_path):
    """A GGUF cut inside its header (or with random bytes after the magic)
    raised struct.error from the parser: a ValueError naming the file now."""
    p = tmp_path / "bad.gguf"
    data = open(tiny_path, "rb").read()
    rng = np.random.default_rng(abs(cut))
    p.write_bytes(data[:cut] if cut > 0 else b"GGUF" + rng.integers(0, 256, 300, dtype=np.uint8).tobytes())
    # (random bytes after the magic mostly make a version other than 2 or 3)
    with pytest.raises(ValueError, match="not a valid or complete GGUF file|GGUF version .* is not supported") as info:
        km.GGUFFile(str(p))
    assert str(p) in str(info.value)


def _hostile_gguf(tensors, kvs=b"", nkv=0, version=3):
    """A GGUF file of the given tensor table and metadata entries."""
    import struct

    body = b"GGUF" + struct.pack("<IQQ", version, len(tensors), nkv) + kvs + b"".join(tensors)
    return body + b"\0" * ((-len(body)) % 32) + b"\0" * 4096


def _gguf_str(text):
    import struct

    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _gguf_tensor(name, dims, ttype=0, offset=0):
    import struct

    head = _gguf_str(name) + struct.pack("<I", len(dims))
    return head + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ttype, offset)


def _hostile_gguf_cases():
    import struct

    alignment = _gguf_str("general.alignment")
    return {
        # u32 0 and f32 0.5: a division by zero
        "alignment 0": (_hostile_gguf([_gguf_tensor("a", [4])], alignment + struct.pack("<II", 4, 0), 1), "alignment"),
        "alignment 0.5": (
            _hostile_gguf([_gguf_tensor("a", [4])], alignment + struct.pack("<If", 6, 0.5), 1),
            "alignment",
        ),
        # i32 -32: the data offset fell inside the tensor table
        "alignment -32": (
            _hostile_gguf([_gguf_tensor("a", [4])], alignment + struct.pack("<Ii", 5, -32), 1),
            "alignment",
        ),
        # arrays nested 5,000 deep: RecursionError
        "nested": (
            _hostile_gguf(
                [_gguf_tensor("a", [4])],
                _gguf_str("x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0),
                1,
            ),
            "nested",
        ),
        # f32 [2**62 + 1, 4]: 2**66 + 16 bytes, which wrapped to 16
        "size wrap": (_hostile_gguf([_gguf_tensor("token_embd.weight", [2**62 + 1, 4])]), "past the end"),
        "same name twice": (_hostile_gguf([_gguf_tensor("a", [4]), _gguf_tensor("a", [4], offset=32)]), "twice"),
        "version 99": (_hostile_gguf([_gguf_tensor("a", [4])], version=99), "version 99"),
    }


@pytest.mark.parametrize("case", list(_hostile_gguf_cases()))
def test_hostile_gguf_headers_are_value_errors(case, tmp_path):
    """Headers that raised ZeroDivisionError or RecursionError, or were
    taken with a wrapped tensor size, a data offset inside the header, a
    tensor dropped for its namesake or an unknown version."""
    data, word = _hostile_gguf_cases()[case]
    p = tmp_path / "hostile.gguf"
    p.write_bytes(data)
    with pytest.raises(ValueError, match=word) as info:
        km.GGUFFile(str(p))
    assert str(p) in str(info.value)


def test_add_gguf_of_a_missing_file_is_a_kvh_io_error(tmp_path):
    import kvh_cache as kvh

    with kvh.Engine(num_layers=1, num_kv_heads=1, head_dim=64, dtype="f32", device_bytes=1 << 22) as eng:
        ctx = eng.context("weights")
        with pytest.raises(kvh.KvhIOError, match="No such file"):
            ctx.add_gguf(tmp_path / "missing.gguf")


def test_model_path_that_is_not_a_regular_file(tmp_path):
    """/dev/null, /dev/zero or a FIFO "did not exist" (and a FIFO would
    block the open): they are not regular files."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/null", "/dev/zero", str(fifo), str(tmp_path)):
        with pytest.raises(runner_mod.ModelFileError, match="not a regular file"):
            km.load(path, cache=False)
        with pytest.raises(ValueError, match="not a regular file"):
            km.GGUFFile(path)
    with pytest.raises(km.ModelNotFoundError, match="does not exist"):
        km.load(str(tmp_path / "missing.gguf"), cache=False)


def test_non_llama_architecture_is_refused(tmp_path):
    import gguf

    p = str(tmp_path / "gpt2.gguf")
    w = gguf.GGUFWriter(p, "gpt2")
    w.add_block_count(1)
    w.add_tensor("x", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with km.GGUFFile(p) as g, pytest.raises(ValueError, match="not Llama-family"):
        km.load_config(g)


def test_missing_default_model_says_how_to_fetch(monkeypatch):
    monkeypatch.delenv("KVH_MODEL", raising=False)
    monkeypatch.setattr(runner_mod.fetch, "installed_path", lambda: None)
    monkeypatch.setattr(runner_mod.fetch, "cached_path", lambda: None)
    with pytest.raises(km.ModelNotFoundError, match="python -m kvh_cache.model fetch"):
        km.default_model_path()


def test_kvh_model_env_overrides_default(monkeypatch, tiny_path):
    monkeypatch.setenv("KVH_MODEL", tiny_path)
    assert km.default_model_path() == tiny_path


# ---------------------------------------------------------------------------------
# tokenizer (tiny vocabulary)
# ---------------------------------------------------------------------------------
TEXTS = [
    "the cat and the hat",
    "  leading spaces, trailing spaces  ",
    "digits 12345 and 3.14159; tabs\tand\nnewlines\r\n",
    "naïve café — 日本語 🙂 Ünïcödé",
    "",
    "x",
    "'s 're 've 'll 'd 'm ''",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_tokenizer_round_trip(tiny, text):
    tk = tiny.tokenizer
    ids = tk.encode(text)
    assert tk.decode(ids) == text


def test_tiny_tokenizer_merges_and_digits(tiny):
    tk = tiny.tokenizer
    ids = tk.encode(" the")
    assert [tk.tokens[i] for i in ids] == ["Ġthe"]
    # the smollm pre-tokenizer splits every digit on its own
    assert [tk.decode([i]) for i in tk.encode("2024")] == ["2", "0", "2", "4"]


def test_tiny_tokenizer_special_tokens(tiny):
    tk = tiny.tokenizer
    ids = tk.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    plain = tk.encode("<|im_start|>", special=False)
    assert 1 not in plain and tk.decode(plain) == "<|im_start|>"
    assert tk.decode(ids, skip_special=True) == "user\nhi"
    assert set(tk.stop_ids) == {0, 2}  # eos and the <|endoftext|> / <|im_end|> end-of-generation tokens


def test_chat_template(tiny):
    tk = tiny.tokenizer
    text = tk.chat([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    text = tk.chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], add_generation_prompt=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"


@pytest.fixture(scope="module")
def tiny_spm(tiny_dir):
    return km.load(write_tiny_llama(str(tiny_dir / "spm.gguf"), tokenizer="spm", seed=6), cache=False)


@pytest.mark.parametrize("text", TEXTS + ["<s>hello</s> world", "two  spaces   three"])
def test_spm_tokenizer_round_trip(tiny_spm, text):
    tk = tiny_spm.tokenizer
    assert isinstance(tk, km.SpmTokenizer)
    ids = tk.encode(text)
    assert ids[0] == tk.bos_id  # add_bos_token is true in the file
    assert tk.decode(ids[1:]) == text


def test_spm_tokenizer_pieces(tiny_spm):
    tk = tiny_spm.tokenizer
    names = lambda text: [tk.tokens[i] for i in tk.encode(text, add_bos=False)]  # noqa: E731
    assert names("the cat and the hat") == ["▁the", "▁cat", "▁and", "▁the", "▁hat"]
    assert names("é") == ["▁", "<0xC3>", "<0xA9>"]  # byte fallback for a character not in the vocabulary
    assert names("a  b") == ["▁a", "▁▁", "b"]  # highest-scoring pairs merge first
    assert names("<s>x") == ["<s>", "▁", "x"]  # space prefix after a special token, as llama.cpp


# ---------------------------------------------------------------------------------
# forward pass: reference pieces and kvh vs the NumPy reference (tiny model)
# ---------------------------------------------------------------------------------
def test_causal_attention_matches_naive_loop():
    rng = np.random.default_rng(4)
    n, T, hq, hkv, d = 3, 7, 4, 2, 8
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k = rng.standard_normal((T, hkv, d)).astype(np.float32)
    v = rng.standard_normal((T, hkv, d)).astype(np.float32)
    pos0 = T - n
    got = km.causal_attention(q, k, v, pos0)
    for i in range(n):
        for h in range(hq):
            kh = h // (hq // hkv)
            s = (k[: pos0 + i + 1, kh].astype(np.float64) @ q[i, h]) / np.sqrt(d)
            w = np.exp(s - s.max())
            w /= w.sum()
            np.testing.assert_allclose(got[i, h], w @ v[: pos0 + i + 1, kh], rtol=1e-6, atol=1e-6)


def test_chunked_prefill_equals_one_shot_and_decode(tiny):
    toks = tiny.tokenizer.encode("the cat and the hat and the other one") * 3
    full = tiny.logits_teacher_forced(toks, chunk=len(toks))
    chunked = tiny.logits_teacher_forced(toks, chunk=5)
    np.testing.assert_allclose(chunked, full, rtol=0, atol=1e-4)
    kv = tiny.reference_kv()
    tiny.prefill(kv, toks[:10])
    for i in range(10, len(toks)):
        lg = tiny.decode_step(kv, toks[i])
        np.testing.assert_allclose(lg, full[i], rtol=0, atol=1e-4)


@pytest.mark.parametrize("attention", ["readback", "auto"])
def test_tiny_greedy_kvh_equals_reference(tiny, attention):
    prompt = tiny.tokenizer.encode("the cat and the hat")
    ref = tiny.generate(prompt, 40, backend="reference", stop=False, return_logits=True)
    with tiny.engine(block_tokens=16) as eng:
        kv = tiny.kvh_kv(eng, attention=attention)
        got = tiny.generate(prompt, 40, kv=kv, stop=False, return_logits=True)
        assert kv.seq.length == len(prompt) + 39
    assert got.tokens == ref.tokens
    diff = max(float(np.abs(a - b).max()) for a, b in zip(got.logits, ref.logits))
    assert diff < 1e-3, diff
    assert got.attention in ("kernel", "readback")


def test_prefill_accepts_a_kvh_sequence_and_reports_progress(tiny):
    toks = tiny.tokenizer.encode("the cat and the hat and more text here")
    seen = []
    with tiny.engine() as eng, eng.sequence() as seq:
        lg = tiny.prefill(seq, toks, chunk=4, progress=lambda d, t: seen.append((d, t)))
        assert seq.length == len(toks)
        lg2 = tiny.decode_step(seq, int(np.argmax(lg)))
    assert seen[-1] == (len(toks), len(toks)) and len(seen) == (len(toks) + 3) // 4
    ref = tiny.reference_kv()
    want = tiny.prefill(ref, toks)
    np.testing.assert_allclose(lg, want, atol=1e-3)
    np.testing.assert_allclose(lg2, tiny.decode_step(ref, int(np.argmax(want))), atol=1e-3)


def test_quantize_dequantize_error_bounds():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 3, 64)).astype(np.float32)
    for bits, step_frac in ((8, 0.5 * 1.13 / 127), (4, 1.01 / 8)):
        # int8: half a step (plus the float16 rounding of the scale);
        # 4-bit (Q4_0 style, the extreme maps to -8): one step for values
        # that clip at +7
        y = km.quantize_dequantize(x, bits)
        g = x.reshape(-1, 32)
        bound = np.abs(g).max(axis=1, keepdims=True) * step_frac + 1e-6
        assert np.all(np.abs((y - x).reshape(-1, 32)) <= bound)


def test_context_past_the_device_tier_raises_and_leaves_the_sequence(tiny):
    """A forward pass holds the whole sequence in the device tier: past its
    size kvh says NoSpaceError and the sequence keeps its earlier length."""
    import kvh_cache as kvh

    with tiny.engine() as e0:
        bb = e0.block_bytes
    with tiny.engine(device_bytes=2 * bb, host_bytes=8 * bb) as eng:
        kv = tiny.kvh_kv(eng, attention="kernel")
        tiny.prefill(kv, list(range(3, 30)))
        with pytest.raises(kvh.NoSpaceError):
            tiny.prefill(kv, list(range(3, 30)))
        assert kv.seq.length == 27
        assert tiny.decode_step(kv, 5).shape == (tiny.config.vocab_size,)  # still usable
