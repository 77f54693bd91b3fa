"""Paged attention through the API: UnsupportedError until the kernels land,
then the result must match a NumPy reference."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_testutil import filled_seq, reference_attention


def _engine(dtype="f32"):
    return kvh.Engine(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        block_tokens=16,
        dtype=dtype,
        backend="cpu",
        device_bytes=1 << 20,
        host_bytes=1 << 20,
    )


@pytest.mark.parametrize("q_heads", [2, 4])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_decode_matches_reference(q_heads, dtype):
    with _engine(dtype) as eng:
        seqs = [filled_seq(eng, n, seed=i, first_token=100 * i) for i, n in enumerate((5, 16, 37))]
        holds = [s.acquire() for s, _ in seqs]
        q = np.random.default_rng(0).standard_normal((3, q_heads, 16)).astype(np.float32)
        try:
            out = eng.attention_decode(1, [s for s, _ in seqs], q)
        except kvh.UnsupportedError:
            pytest.skip("attention kernels are not in this build")
        assert out.shape == q.shape and out.dtype == np.float32
        tol = 1e-4 if dtype == "f32" else 2e-3
        for i, (s, ref) in enumerate(seqs):
            k, v = ref[1]
            want = reference_attention(k.astype(np.float32), v.astype(np.float32), q[i])
            np.testing.assert_allclose(out[i], want, atol=tol, rtol=tol)
        # explicit out= and scale
        out2 = np.empty_like(q)
        assert eng.attention_decode(1, [s for s, _ in seqs], q, out=out2, scale=0.5) is out2
        want = reference_attention(
            seqs[0][1][1][0].astype(np.float32), seqs[0][1][1][1].astype(np.float32), q[0], scale=0.5
        )
        np.testing.assert_allclose(out2[0], want, atol=tol, rtol=tol)
        # A scale too small for a C float is a scale near 0 (every token
        # weighed alike), not 0 (the default 1/sqrt(head_dim)).
        k0, v0 = (a.astype(np.float32) for a in seqs[0][1][1])
        flat = reference_attention(k0, v0, q[0], scale=1e-30)
        for tiny in (1e-46, 1e-300):
            got = eng.attention_decode(1, [s for s, _ in seqs], q, scale=tiny)
            np.testing.assert_allclose(got[0], flat, atol=tol, rtol=tol)
        # A NumPy half is taken as its value, with no overflow on the way.
        with np.errstate(all="raise"):
            half = eng.attention_decode(1, [s for s, _ in seqs], q, scale=np.float16(0.5))
        np.testing.assert_array_equal(half, out2)
        for h in holds:
            h.release()


def test_decode_needs_residency():
    with kvh.Engine(
        num_layers=1, num_kv_heads=2, head_dim=16, dtype="f32", backend="cpu", device_bytes=1 << 20, host_bytes=1 << 20
    ) as eng:
        s, _ = filled_seq(eng, 20)
        s.migrate("host")
        q = np.zeros((1, 2, 16), np.float32)
        with pytest.raises((kvh.NotResidentError, kvh.UnsupportedError)):
            eng.attention_decode(0, [s], q)


def test_prefill_matches_reference():
    with _engine() as eng:
        s, ref = filled_seq(eng, 40, seed=3)
        q_len = 6
        q = np.random.default_rng(1).standard_normal((q_len, 4, 16)).astype(np.float32)
        with s.acquire():
            try:
                out = eng.attention_prefill(0, [s], [q_len], q)
            except kvh.UnsupportedError:
                pytest.skip("attention kernels are not in this build")
        k, v = ref[0]
        for j in range(q_len):
            upto = 40 - q_len + j + 1  # causal: up to and including itself
            want = reference_attention(k[:upto], v[:upto], q[j])
            np.testing.assert_allclose(out[j], want, atol=1e-4, rtol=1e-4)


def test_streamed_decode_and_prefill_over_a_sequence_larger_than_the_device_tier(tmp_path):
    """A 400-token sequence with a 4-block device tier, on host and disk:
    attended through a streaming window, against the NumPy reference."""
    with kvh.Engine(
        num_layers=1,
        num_kv_heads=2,
        head_dim=16,
        block_tokens=16,
        dtype="f32",
        backend="cpu",
        device_bytes=4 * 4096,
        host_bytes=8 * 4096,
        disk_path=str(tmp_path / "store"),
        disk_bytes=64 * 8192,
    ) as eng:
        s, ref = filled_seq(eng, 400, seed=9)
        s.migrate("disk")
        before = eng.stats()
        q = np.random.default_rng(2).standard_normal((1, 4, 16)).astype(np.float32)
        k, v = ref[0]
        with pytest.raises(kvh.NotResidentError):
            eng.attention_decode(0, [s], q)
        with pytest.raises(kvh.InvalidArgumentError, match="smaller than one chunk"):
            eng.attention_decode(0, [s], q, stream_chunk_blocks=4, stream_window_blocks=2)
        out = eng.attention_decode(0, [s], q, stream_chunk_blocks=2, stream_window_blocks=4)
        np.testing.assert_allclose(out[0], reference_attention(k, v, q[0]), atol=1e-4, rtol=1e-4)
        qp = np.random.default_rng(3).standard_normal((5, 4, 16)).astype(np.float32)
        outp = eng.attention_prefill(0, [s], [5], qp, stream_chunk_blocks=3, stream_window_blocks=3)
        for j in range(5):
            upto = 400 - 5 + j + 1
            np.testing.assert_allclose(outp[j], reference_attention(k[:upto], v[:upto], qp[j]), atol=1e-4, rtol=1e-4)
        # nothing was promoted
        after = eng.stats()
        assert after.blocks_disk_to_host == before.blocks_disk_to_host
        assert after.blocks_host_to_device == before.blocks_host_to_device


def test_plan_q_lens_must_match_the_sequences():
    """attention_plan passed q_lens as given and the sequence count apart:
    the library read one entry per sequence, past the end of a shorter
    list (rows of garbage: "sequence 2: 1889 query tokens"), and a longer
    list sized q and out for rows the kernels never used. scale="x" was a
    bare float() error and NaN reached the library."""
    with _engine() as eng:
        seqs = [filled_seq(eng, 20)[0] for _ in range(4)]
        for lens in ([1], [1, 1], [1] * 5):
            with pytest.raises(ValueError, match="q_lens"):
                eng.attention_plan(0, seqs, lens)
        with pytest.raises(TypeError, match="scale"):
            eng.attention_plan(0, seqs, scale="x")
        with pytest.raises(ValueError, match="scale"):
            eng.attention_decode(0, seqs, np.ones((4, 2, 16), np.float32), scale=float("nan"))
        # An endless q_lens is refused after one entry too many, not read
        # for ever.
        with pytest.raises(ValueError, match=r"q_lens has more than 4 entries"):
            eng.attention_plan(0, seqs, itertools.repeat(1))
        with pytest.raises(ValueError, match=r"q_lens has more than 4 entries"):
            eng.attention_prefill(0, seqs, itertools.repeat(1), np.ones((4, 2, 16), np.float32))
        with pytest.raises(ValueError, match=r"q_lens has more than 4 entries"):
            eng.attention_prefill(0, seqs, range(1 << 62), np.ones((4, 2, 16), np.float32))
        plan = eng.attention_plan(0, seqs, [1, 2, 1, 1])
        out = plan.run(np.ones((5, 2, 16), np.float32))
        assert out.shape == (5, 2, 16) and np.isfinite(out).all()
        plan.destroy()


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_split_and_streamed_sums_keep_their_weights_at_large_scores(dtype):
    """A sequence split into chunks (split-K over threads, or streamed) was
    merged through m + log(l) in float: at scores near 2^20, log(l) fell
    below a float's step at m, and chunks of 256 and 100 tokens weighed
    alike (1.4e-2 relative off with split-K, 2.7e-2 streamed; exact on
    one thread). Every score here is exactly 1024 x 1024 = 2^20."""
    n = 2148
    with kvh.Engine(
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        block_tokens=16,
        dtype=dtype,
        backend="cpu",
        device_bytes=64 << 20,
        host_bytes=64 << 20,
    ) as eng:
        seq = eng.sequence(tokens=np.arange(n))
        v = np.zeros((n, 1, 1), eng.np_dtype)
        v[-100:] = 1
        seq.write_kv(0, 0, np.full((n, 1, 1), 1024, eng.np_dtype), v)
        q = np.full((1, 1, 1), 1024, np.float32)
        want = 100 / n
        got = {}
        with seq.acquire():
            for threads in (1, 2, 4):
                got[f"threads={threads}"] = eng.attention_decode(0, [seq], q, scale=1.0, threads=threads)[0, 0, 0]
        seq.migrate("host", 0, n)
        got["streamed"] = eng.attention_decode(
            0, [seq], q, scale=1.0, threads=2, stream_chunk_blocks=4, stream_window_blocks=8
        )[0, 0, 0]
        for how, out in got.items():
            assert abs(out - want) <= 1e-6 * want, (how, out, want)
