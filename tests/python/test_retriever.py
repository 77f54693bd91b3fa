"""The speculative retriever (kvh_cache.retriever, kvh_cache.embed, kvh_cache.demo.bench_retriever):
chunks stored in kvh under their content hash, embeddings in Qdrant (embedded
local mode) or NumPy, predictions turned into prefetch hints, and the
accounting (precision / recall, kvh's prefetch counters)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

import kvh_cache as kvh
from kvh_cache import embed, retrieval, retriever
from kvh_cache.demo import bench_retriever
from kvh_cache.retriever import SpeculativeRetriever, SyntheticKV
from kvh_cache.types import Tier

REPO = Path(__file__).resolve().parents[2]

needs_qdrant = pytest.mark.skipif(
    not retriever.qdrant_available(), reason="qdrant-client is not installed (pip install qdrant-client)"
)

CHUNK_TOKENS = 64  # 4 blocks of 16


@pytest.fixture(scope="module")
def corpus():
    """3 topics x 2 documents x 2 sections of topic-coherent synthetic text."""
    return bench_retriever.make_corpus(3, 2, 2, CHUNK_TOKENS, seed=5)


def _engine(tmp_path=None, **kw):
    """4 KiB blocks; a device tier of 8 chunks, host 16 chunks, disk when tmp_path."""
    base = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        block_tokens=16,
        dtype="f16",
        backend="cpu",
        device_bytes=32 * 4096,
        host_bytes=64 * 4096,
        model_salt=0x5E7,
        log_level="error",
    )
    if tmp_path is not None:
        base.update(disk_path=str(tmp_path / "store"), disk_bytes=16 << 20)
    base.update(kw)
    return kvh.Engine(**base)


def _items(corpus):
    return [
        {"tokens": corpus.tokens(i), "text": c.text, "doc": f"t{c.topic}d{c.doc}", "index": c.section}
        for i, c in enumerate(corpus.chunks)
    ]


def _tiers(r, cid):
    return [b.info().tier for b in r.blocks(cid)]


# ---------------------------------------------------------------------------------
# embeddings
# ---------------------------------------------------------------------------------
def test_hashed_embedder_properties():
    e = embed.HashedNgramEmbedder(256)
    a, b, c, z = e.embed(
        [
            "The quick brown fox jumps over the lazy dog",
            "the quick brown fox jumped over a lazy dog",
            "Compilers lower SSA form into machine code",
            "",
        ]
    )
    assert e.dim == 256 and a.dtype == np.float32 and a.shape == (256,)
    assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-5
    assert float(a @ b) > 0.6 > 0.2 > float(a @ c)
    assert not z.any()  # no features: a zero vector, not NaN
    # deterministic across instances (no salted hash) and independent of batching
    again = embed.HashedNgramEmbedder(256).embed(["the quick brown fox jumped over a lazy dog"])[0]
    assert np.array_equal(again, b)
    assert np.array_equal(e.embed_one("Compilers lower SSA form into machine code"), c)
    assert e.embed([]).shape == (0, 256)
    assert not np.array_equal(embed.HashedNgramEmbedder(256, seed=1).embed(["fox"])[0], e.embed(["fox"])[0])
    with pytest.raises(TypeError):
        e.embed("a bare string")
    with pytest.raises(ValueError):
        embed.HashedNgramEmbedder(0)
    with pytest.raises(ValueError):
        embed.HashedNgramEmbedder(64, ngrams=())


def test_open_embedder_specs(monkeypatch):
    assert embed.open_embedder("hash").dim == embed.DEFAULT_DIM
    assert embed.open_embedder("hash:128").dim == 128
    monkeypatch.setenv("KVH_EMBEDDER", "hash:96")
    assert embed.open_embedder("auto").dim == 96
    custom = embed.CallableEmbedder(lambda texts: np.ones((len(texts), 3)), 3, name="ones")
    assert embed.open_embedder(custom) is custom
    assert np.allclose(custom.embed(["x"])[0], 1 / np.sqrt(3))
    with pytest.raises(ValueError, match="unknown embedder"):
        embed.open_embedder("word2vec")


def test_word_tokenizer_is_stable():
    t = embed.WordTokenizer()
    assert t.encode("Hello, world!") == t.encode("Hello ,  world !")
    assert len(t.encode("Hello, world!")) == 4
    assert embed.WordTokenizer().encode("kvh") == t.encode("kvh")


class _FakeSentenceTransformer:
    """Stands in for sentence_transformers.SentenceTransformer: embeds with
    the hashed embedder, so the plumbing can be tested without the package."""

    loaded = []

    def __init__(self, name, device=None, **kw):
        self.inner = embed.HashedNgramEmbedder(48)
        _FakeSentenceTransformer.loaded.append(name)

    def get_sentence_embedding_dimension(self):
        return 48

    def encode(self, texts, batch_size=32, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False):
        return self.inner.embed(list(texts))


def test_sentence_transformer_embedder_plumbing(monkeypatch, corpus):
    fake = types.ModuleType("sentence_transformers")
    fake.SentenceTransformer = _FakeSentenceTransformer
    monkeypatch.setitem(sys.modules, "sentence_transformers", fake)
    e = embed.open_embedder("st:my-local-model")
    assert isinstance(e, embed.SentenceTransformerEmbedder) and e.dim == 48 and e.name == "st:my-local-model"
    assert _FakeSentenceTransformer.loaded[-1] == "my-local-model"
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy", embedder=e, top_k=2) as r:
        r.add_chunks(_items(corpus))
        target = r.chunk_ids[5]
        preds = r.predict(corpus.chunks[5].text)
        assert preds and preds[0].chunk_id == target


def test_sentence_transformer_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    with pytest.raises(ImportError, match="pip install sentence-transformers"):
        embed.open_embedder("st:all-MiniLM-L6-v2")


def test_sentence_transformer_real_model():
    pytest.importorskip("sentence_transformers")
    model = os.environ.get("KVH_ST_MODEL", "all-MiniLM-L6-v2")
    try:
        e = embed.SentenceTransformerEmbedder(model)
    except RuntimeError as exc:  # not in the local cache (no network here)
        pytest.skip(f"no sentence-transformers model available: {exc}")
    a, b, c = e.embed(["a cat sat on the mat", "a kitten sits on a rug", "quarterly tax filing deadlines"])
    assert abs(float(np.linalg.norm(a)) - 1) < 1e-4 and float(a @ b) > float(a @ c)


# ---------------------------------------------------------------------------------
# content ids and storage
# ---------------------------------------------------------------------------------
def test_content_id_is_the_kvh_prefix_chain(corpus):
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy") as r:
        toks = corpus.tokens(0)
        h = 0
        for b in range(len(toks) // 16):
            h = eng.prefix_hash(toks[b * 16 : (b + 1) * 16], h)
        assert r.content_id(toks) == h
        rec = r.add_chunk(toks, corpus.chunks[0].text)
        assert rec.chunk_id == h and rec.n_tokens == 64
        assert rec.block_hashes == [b.info().hash for b in r.blocks(h)] and rec.block_hashes[-1] == h
        # a partial tail block continues the chain; a different model salt changes every id
        assert r.content_id(toks[:40]) not in (0, h)
        assert r.content_id(toks[:40]) == r.content_id(toks[:40].copy())
        with _engine(model_salt=0x999) as other, SpeculativeRetriever(other, index="numpy") as r2:
            assert r2.content_id(toks) != h
        # adding the same tokens again is a no-op that returns the same record
        assert r.add_chunk(toks, "other text") is rec and len(r) == 1


def test_model_kv_fn_with_the_real_model():
    """Chunks whose K/V the model computes (kvh_cache.model's runner): what kvh
    holds equals a plain prefill of the chunk's tokens."""
    try:
        from kvh_cache.model import runner as model_runner

        run = model_runner.load()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"no model runner here: {exc}")
    with run.engine(device_bytes=8 << 20, host_bytes=8 << 20) as eng:
        with SpeculativeRetriever(
            eng, index="numpy", kv_fn=retriever.model_kv_fn(run), tokenizer=run.tokenizer, top_k=1
        ) as r:
            recs = r.add_document(
                "paris", "The capital of France is Paris, known for the Eiffel Tower. " * 2, chunk_tokens=16
            )
            recs += r.add_document(
                "plants", "Photosynthesis turns light into chemical energy with chlorophyll.", chunk_tokens=32
            )
            assert r.record(r.predict("how do plants use chlorophyll")[0].chunk_id).doc == "plants"
            c = recs[0]
            k, v = r.sequence(c.chunk_id).read_kv(1)
            ref = run.reference_kv()
            run.prefill(ref, [int(t) for t in c.tokens])
            rk, rv = ref.read(1)
            assert np.allclose(k, rk[: len(k)], atol=1e-5) and np.allclose(v, rv[: len(v)], atol=1e-5)


def test_kv_fn_must_append_its_tokens(corpus):
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy", kv_fn=lambda seq, toks: None) as r:
        with pytest.raises(RuntimeError, match="kv_fn must append"):
            r.add_chunk(corpus.tokens(0), "x")
        assert len(r) == 0


# ---------------------------------------------------------------------------------
# end to end with the embedded Qdrant
# ---------------------------------------------------------------------------------
def _demote_all(r, tier):
    for cid in r.chunk_ids:
        r.sequence(cid).migrate(tier)
    for cid in r.chunk_ids:
        assert all(t == tier for t in _tiers(r, cid)), (cid, _tiers(r, cid))


@needs_qdrant
def test_end_to_end_embedded_qdrant(tmp_path, corpus):
    with _engine(tmp_path) as eng:
        with SpeculativeRetriever(eng, qdrant_path=str(tmp_path / "qdrant"), top_k=3) as r:
            assert isinstance(r.index, retriever.QdrantChunkIndex) and r.index.mode == "local"
            recs = r.add_chunks(_items(corpus))
            assert len(r) == 12 and r.index.count() == 12
            kv = r.kv_fn
            assert isinstance(kv, SyntheticKV)
            # the point payload is the chunk record
            payload = r.index.get([recs[3].chunk_id])[recs[3].chunk_id]
            assert payload["tokens"] == [int(t) for t in corpus.tokens(3)] and payload["n_tokens"] == 64
            assert payload["doc"] == "t0d1" and payload["index"] == 1
            assert payload["block_hashes"] == [f"{h:016x}" for h in recs[3].block_hashes]
            # everything starts on disk: nothing of the corpus is in the device tier
            _demote_all(r, Tier.DISK)
            before = eng.stats()
            # agent 1 reads topic 2, document 0, section 0 and talks about section 1 next
            nxt = corpus.index(2, 0, 1)
            context = corpus.chunks[corpus.index(2, 0, 0)].text + " next: " + " ".join(corpus.chunks[nxt].keys)
            res = r.prefetch(context, agent=1)
            assert recs[nxt].chunk_id in res.chunk_ids
            assert res.hinted == res.chunk_ids and not res.resident  # nothing was resident
            assert [p.rank for p in res.predictions] == [0, 1, 2]
            assert res.wait(timeout=30)
            # the predicted chunks' blocks are in the device tier before the agent asks
            for cid in res.chunk_ids:
                assert all(t == Tier.DEVICE for t in _tiers(r, cid)), _tiers(r, cid)
            mid = eng.stats() - before
            assert mid.prefetch_issued == 3 * 4 and mid.prefetch_skipped == 0
            # acquire: no stall, the prefetched blocks count as useful
            with r.acquire(recs[nxt].chunk_id, agent=1):
                assert kv.check(r.sequence(recs[nxt].chunk_id), corpus.tokens(nxt), layer=1)
            after = eng.stats() - before
            assert after.acquire_stall_ns == 0
            assert after.prefetch_useful == 4 and after.prefetch_late == 0
            # demote the two predicted chunks that were not used: they were prefetched for nothing
            unused = [c for c in res.chunk_ids if c != recs[nxt].chunk_id]
            for cid in unused:
                r.sequence(cid).migrate(Tier.HOST)
            end = eng.stats() - before
            assert end.prefetch_wasted == 2 * 4
            # the counters add up: every issued block was used, or evicted unused (none late, none left)
            assert end.prefetch_issued == end.prefetch_useful + end.prefetch_wasted + end.prefetch_late
            # a second prediction closes agent 1's window: precision 1/3, recall 1/1
            r.prefetch(corpus.chunks[nxt].text, agent=1)
            m = r.metrics()
            assert (m.windows, m.predicted, m.used, m.hits) == (1, 3, 1, 1)
            assert m.precision == pytest.approx(1 / 3) and m.recall == 1.0
            assert m.kvh["prefetch_issued"] >= 12 and m.predictions == 2
            r.end_windows()
            assert r.metrics().windows == 2


@needs_qdrant
def test_resident_chunks_get_no_hint(tmp_path, corpus):
    with _engine(tmp_path) as eng, SpeculativeRetriever(eng, qdrant_path=str(tmp_path / "q"), top_k=2) as r:
        recs = r.add_chunks(_items(corpus))
        _demote_all(r, Tier.HOST)
        target = recs[7].chunk_id
        with r.acquire(target):
            pass
        assert r.resident(target)
        st0 = eng.stats()
        res = r.prefetch(corpus.chunks[7].text)
        assert res.chunk_ids[0] == target and target in res.resident and target not in res.hinted
        res.wait(30)
        assert (eng.stats() - st0).prefetch_issued == 4 * len(res.hinted)


@needs_qdrant
def test_async_prefetch_and_accounting(tmp_path, corpus):
    with _engine(tmp_path) as eng, SpeculativeRetriever(eng, qdrant_path=str(tmp_path / "q"), top_k=2) as r:
        recs = r.add_chunks(_items(corpus))
        a, b = recs[0].chunk_id, recs[6].chunk_id
        fut = r.prefetch_async(corpus.chunks[0].text, agent=7)
        # the window is open at once: this use counts against the prediction even if it is still running
        with r.acquire(a, agent=7):
            pass
        res = fut.result(30)
        assert a in res.chunk_ids
        r.note_use(b, agent=7)  # used, not predicted
        r.note_use(a, agent=8)  # agent 8 has no window yet
        r.end_windows()
        m = r.metrics()
        assert (m.predicted, m.used, m.hits, m.unwindowed_uses) == (2, 2, 1, 1)
        assert m.precision == 0.5 and m.recall == 0.5
        assert m.predict_seconds_p50 > 0
        r.reset_metrics()
        assert r.metrics().predicted == 0


@needs_qdrant
def test_draft_continuation_steers_the_prediction(tmp_path, corpus):
    target = corpus.index(1, 1, 1)
    seen = []

    def draft(text):
        seen.append(text)
        return " ".join(corpus.chunks[target].keys * 3)

    with (
        _engine(tmp_path) as eng,
        SpeculativeRetriever(eng, qdrant_path=str(tmp_path / "q"), top_k=1, draft=draft) as r,
    ):
        recs = r.add_chunks(_items(corpus))
        generic = "and then we will read about the other one as well"
        assert r.predict(generic)[0].chunk_id == recs[target].chunk_id
        assert seen == [generic]
        r.draft = None
        here = corpus.chunks[corpus.index(0, 0, 0)].text
        assert r.predict(here)[0].chunk_id == recs[corpus.index(0, 0, 0)].chunk_id
        # a continuation the caller already has
        res = r.prefetch(generic, draft_text=" ".join(corpus.chunks[target].keys * 3))
        assert res.chunk_ids == [recs[target].chunk_id]


@needs_qdrant
def test_restart_finds_chunks_on_disk(tmp_path, corpus):
    qpath = str(tmp_path / "qdrant")
    with _engine(tmp_path) as eng, SpeculativeRetriever(eng, qdrant_path=qpath) as r:
        recs = r.add_chunks(_items(corpus))
        assert r.persist() == 12
        ids = [x.chunk_id for x in recs]
    # a new process: same store, same Qdrant directory
    with _engine(tmp_path) as eng, SpeculativeRetriever(eng, qdrant_path=qpath, top_k=2) as r:
        assert r.load() == 12 and sorted(r.chunk_ids) == sorted(ids)
        assert r.reused_tokens == 0  # attached lazily
        res = r.prefetch(corpus.chunks[9].text)
        assert res.chunk_ids[0] == ids[9]
        assert r.computed_tokens == 0 and r.reused_tokens == 2 * 64  # found in kvh, not recomputed
        res.wait(30)
        with r.acquire(ids[9]):
            assert SyntheticKV(eng).check(r.sequence(ids[9]), corpus.tokens(9), layer=0)
        # records the index only knows (not loaded) are fetched on demand
        r2 = SpeculativeRetriever(eng, index=r.index, top_k=1)
        assert r2.predict(corpus.chunks[4].text)[0].chunk_id == ids[4]
        r2.close()


# ---------------------------------------------------------------------------------
# the Qdrant index itself
# ---------------------------------------------------------------------------------
@needs_qdrant
def test_qdrant_index_basics(tmp_path):
    path = str(tmp_path / "q")
    with retriever.QdrantChunkIndex(4, path=path, collection="t") as idx:
        assert isinstance(idx, retrieval.ChunkIndex)
        big = (1 << 64) - 3
        idx.add([1, 2, big], np.eye(4, dtype=np.float32)[:3], [{"agent": 1}, {}, {"doc": "x"}])
        assert idx.count() == 3 and idx.has([1, 5, big]) == {1, big}
        assert idx.search(np.array([1, 0.1, 0, 0]), 2)[0][0] == 1
        assert idx.search(np.array([0, 0, 1, 0]), 1)[0][0] == big
        # agent filter: that agent's points and shared ones (no agent in the payload)
        assert {i for i, _ in idx.search(np.array([1, 1, 1, 0]), 3, agent=2)} == {2, big}
        assert idx.get([big])[big]["doc"] == "x" and dict(idx.scroll())[2] == {}
        assert idx.search(np.zeros(4), 3) == []
        with pytest.raises(RuntimeError, match="already accessed"):
            retriever.QdrantChunkIndex(4, path=path, collection="t")
        with pytest.raises(ValueError):
            idx.add([1], np.zeros((1, 3)))
        with pytest.raises(ValueError):
            idx.add([-1], np.ones((1, 4)))
        idx.delete([2])
        assert idx.count() == 2
    with retriever.QdrantChunkIndex(4, path=path, collection="t") as idx:
        assert idx.count() == 2  # persistent
    with pytest.raises(RuntimeError, match="4-dim vectors"):
        retriever.QdrantChunkIndex(8, path=path, collection="t")
    with retriever.QdrantChunkIndex(8, path=path, collection="t", recreate=True) as idx:
        assert idx.count() == 0
    tmp = retriever.QdrantChunkIndex(4)
    where = tmp.location
    assert Path(where).is_dir()
    tmp.close()
    assert not Path(where).exists()  # a temporary store is removed


@needs_qdrant
def test_qdrant_server_url_errors_clearly():
    with pytest.raises(RuntimeError, match="cannot reach the Qdrant server at http://127.0.0.1:1"):
        retriever.QdrantChunkIndex(4, url="http://127.0.0.1:1", timeout=2)
    with pytest.raises(RuntimeError, match="cannot reach"):
        retriever.demo_chunk_index("auto", 8, "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="--qdrant-url"):
        retriever.demo_chunk_index("numpy", 8, "http://127.0.0.1:1")


@needs_qdrant
def test_qdrant_server_code_path(monkeypatch, corpus, caplog):
    """With a URL the index takes the server branch (QdrantClient(url=...)); a
    stand-in client that serves it from qdrant-client's in-memory mode checks
    that everything else is the same code path."""
    from qdrant_client import QdrantClient, models

    made = []

    class ServerStandIn(QdrantClient):
        def __init__(self, url=None, api_key=None, prefer_grpc=False, timeout=None, check_compatibility=True):
            made.append({"url": url, "api_key": api_key, "check_compatibility": check_compatibility})
            super().__init__(location=":memory:")

        def info(self):
            return types.SimpleNamespace(version="0.1.0")  # far from the client's: a logged warning

    monkeypatch.setattr(retriever, "_qdrant", lambda: (ServerStandIn, models))
    monkeypatch.setenv("KVH_QDRANT_API_KEY", "secret")
    with caplog.at_level("WARNING", logger="kvh_cache.retriever"):
        with (
            _engine() as eng,
            SpeculativeRetriever(eng, qdrant_url="http://qdrant.example:6333", top_k=2, collection="kvh_test") as r,
        ):
            assert r.index.mode == "server" and r.index.location == "http://qdrant.example:6333"
            assert made == [{"url": "http://qdrant.example:6333", "api_key": "secret", "check_compatibility": False}]
            recs = r.add_chunks(_items(corpus))
            assert r.index.count() == 12
            assert r.predict(corpus.chunks[3].text)[0].chunk_id == recs[3].chunk_id
    assert "may not work with Qdrant server 0.1.0" in caplog.text
    # $KVH_QDRANT_URL is the default location when neither url nor path is given
    monkeypatch.setenv("KVH_QDRANT_URL", "http://from-env:6333")
    idx = retriever.open_chunk_index("auto", 4)
    assert idx.mode == "server" and idx.location == "http://from-env:6333"
    idx.close()


@needs_qdrant
def test_retrieval_plugin_picks_qdrant():
    assert "qdrant" in retrieval.available_kinds()
    idx = retrieval.open_chunk_index("auto", dim=8)
    try:
        assert isinstance(idx, retriever.QdrantChunkIndex)
    finally:
        idx.close()


# ---------------------------------------------------------------------------------
# fallbacks
# ---------------------------------------------------------------------------------
def test_numpy_fallback_end_to_end(corpus):
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy", top_k=2) as r:
        assert isinstance(r.index, retrieval.NumpyChunkIndex)
        recs = r.add_chunks(_items(corpus))
        _demote_all(r, Tier.HOST)
        st0 = eng.stats()
        res = r.prefetch(corpus.chunks[2].text, agent=0)
        assert res.chunk_ids[0] == recs[2].chunk_id
        assert res.wait(30)
        assert all(t == Tier.DEVICE for c in res.chunk_ids for t in _tiers(r, c))
        with r.acquire(recs[2].chunk_id, agent=0):
            pass
        d = eng.stats() - st0
        assert d.acquire_stall_ns == 0 and d.prefetch_useful == 4 and d.prefetch_issued == 8
        with pytest.raises(TypeError, match="cannot list"):
            r.load()


def test_missing_qdrant_client(monkeypatch):
    monkeypatch.setitem(sys.modules, "qdrant_client", None)  # import qdrant_client -> ImportError
    assert not retriever.qdrant_available()
    with pytest.raises(ImportError, match="pip install qdrant-client"):
        retriever.open_chunk_index("qdrant", 8)
    with _engine() as eng:
        with pytest.raises(ImportError, match="pip install qdrant-client"):
            SpeculativeRetriever(eng)  # the default index is Qdrant: a clear error
        with SpeculativeRetriever(eng, index="auto") as r:
            assert isinstance(r.index, retrieval.NumpyChunkIndex)
    assert isinstance(retrieval.open_chunk_index("auto", dim=8), retrieval.NumpyChunkIndex)
    assert isinstance(retriever.demo_chunk_index("auto", 8), retrieval.NumpyChunkIndex)
    rc = bench_retriever.main(["--quick", "--json", "--modes", "speculative"], out=open(os.devnull, "w"))
    assert rc == 3


def test_argument_checks(corpus):
    with _engine() as eng:
        with pytest.raises(TypeError):
            SpeculativeRetriever("not an engine", index="numpy")
        with pytest.raises(ValueError):
            SpeculativeRetriever(eng, index="numpy", top_k=0)
        with pytest.raises(ValueError, match="unknown chunk index"):
            SpeculativeRetriever(eng, index="faiss")
        with pytest.raises(ValueError, match="index dim"):
            SpeculativeRetriever(eng, index=retrieval.NumpyChunkIndex(7))
        with SpeculativeRetriever(eng, index="numpy") as r:
            with pytest.raises(KeyError):
                r.sequence(12345)
            with pytest.raises(TypeError):
                r.prefetch(b"bytes")
            assert r.prefetch("").predictions == []


@pytest.mark.parametrize(
    "bad,error", [("false", TypeError), ("", TypeError), (0.0, TypeError), (None, TypeError), (2, ValueError)]
)
def test_on_off_arguments_take_a_bool(tmp_path, bad, error):
    """recreate="false" used to empty a persistent collection, and
    filter_agents / lowercase / with_payload / prefer_grpc were read by
    their truth as well."""
    with pytest.raises(error, match="lowercase"):
        embed.HashedNgramEmbedder(16, lowercase=bad)
    with _engine() as eng:
        with pytest.raises(error, match="filter_agents"):
            SpeculativeRetriever(eng, index="numpy", filter_agents=bad)
        with pytest.raises(error, match="recreate"):
            SpeculativeRetriever(eng, index="numpy", recreate=bad)
    if not retriever.qdrant_available():
        return
    path = str(tmp_path / "q")
    with retriever.QdrantChunkIndex(4, path=path, collection="t") as idx:
        idx.add([1], np.ones((1, 4), np.float32), [{"doc": "kept"}])
        with pytest.raises(error, match="with_payload"):
            idx.search_payloads(np.ones(4), 1, with_payload=bad)
    with pytest.raises(error, match="recreate"):
        retriever.QdrantChunkIndex(4, path=path, collection="t", recreate=bad)
    with pytest.raises(error, match="prefer_grpc"):
        retriever.QdrantChunkIndex(4, path=path, collection="t", prefer_grpc=bad)
    with retriever.QdrantChunkIndex(4, path=path, collection="t", recreate=0) as idx:
        assert idx.get([1]) == {1: {"doc": "kept"}}


def test_on_off_arguments_take_bools_and_0_1():
    assert (
        embed.HashedNgramEmbedder(16, lowercase=0).embed(["AB"]).tolist()
        != embed.HashedNgramEmbedder(16, lowercase=np.bool_(True)).embed(["AB"]).tolist()
    )
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy", filter_agents=1) as r:
        assert r.filter_agents is True


def test_a_closed_retriever_refuses_work(corpus):
    """After close() the retriever kept attaching chunks: acquire(),
    sequence(), add_chunk() and prefetch() made new kvh sequences that
    nothing freed any more, and a prefetch_async racing the close started
    an executor that was never shut down."""
    with _engine() as eng:
        r = SpeculativeRetriever(eng, index="numpy")
        cid = r.add_chunks(_items(corpus)[:2])[0].chunk_id
        r.close()
        r.close()
        calls = [
            lambda: r.acquire(cid),
            lambda: r.sequence(cid),
            lambda: r.add_chunk(corpus.tokens(3)),
            lambda: r.prefetch("anything"),
            lambda: r.prefetch_async("anything"),
            lambda: r.predict("anything"),
            lambda: r.__enter__(),
        ]
        for call in calls:
            with pytest.raises(kvh.ClosedError, match="retriever is closed"):
                call()
        assert r._seqs == {} and r._executor is None
        # many prefetch_async calls racing a close leave no executor behind
        for _ in range(20):
            r = SpeculativeRetriever(eng, index="numpy")
            r.add_chunks(_items(corpus)[:2])
            errs = []

            def spam(r=r, errs=errs):
                for _ in range(50):
                    try:
                        r.prefetch_async("topic words")
                    except kvh.ClosedError:
                        return
                    except Exception as exc:  # anything else is a defect
                        errs.append(exc)
                        return

            t = threading.Thread(target=spam)
            t.start()
            r.close()
            t.join(30)
            assert not t.is_alive() and not errs and r._executor is None and r._seqs == {}


def test_numeric_arguments_are_checked_and_named(corpus):
    """top_k=2.5 or True, chunk_agent=-1, base_priority=1.5, a string
    min_score or a non-callable kv_fn were taken (and failed later, or
    never); chunk tokens of floats or past int32 were cast, storing the
    chunk under other tokens; predict(k=-1) raised a NumPy error and
    k="2" was parsed."""
    with _engine() as eng:
        for kw, error in (
            (dict(top_k=2.5), TypeError),
            (dict(top_k=True), TypeError),
            (dict(top_k="3"), TypeError),
            (dict(top_k=0), ValueError),
            (dict(decay="0.5"), TypeError),
            (dict(decay=float("nan")), ValueError),
            (dict(context_chars="x"), TypeError),
            (dict(base_priority=1.5), TypeError),
            (dict(chunk_agent=-1), ValueError),
            (dict(draft_weight="w"), TypeError),
            (dict(min_score="s"), TypeError),
            (dict(kv_fn=5), TypeError),
            (dict(tokenizer=5), TypeError),
        ):
            (name,) = kw
            with pytest.raises(error, match=name):
                SpeculativeRetriever(eng, index="numpy", **kw)
        with SpeculativeRetriever(eng, index="numpy") as r:
            tokens = corpus.tokens(0)
            with pytest.raises(TypeError, match="tokens"):
                r.add_chunk(tokens + 0.5)
            with pytest.raises(ValueError, match="int32"):
                r.add_chunk(tokens.astype(np.int64) + (1 << 40))
            with pytest.raises(TypeError, match="chunk_tokens"):
                r.add_document("d", "a b c", chunk_tokens=1.5)
            with pytest.raises(TypeError, match="text"):
                r.add_document("d", None)
            assert len(r) == 0
            r.add_chunks(_items(corpus)[:3])
            for bad, error in ((-1, ValueError), (0, ValueError), (1.5, TypeError), ("2", TypeError)):
                with pytest.raises(error, match="k"):
                    r.predict("words", k=bad)
            with pytest.raises(TypeError, match="chunk_id"):
                r.record("x")
            with pytest.raises(TypeError, match="chunk_ids"):
                r.note_use(["x"])


def test_embedder_and_index_arguments_are_checked():
    """ngrams=(1.5,) became (1,), word_weight=nan made NaN features, a float
    WordTokenizer vocab_size made float token ids, an offset past int32 ids
    kvh refuses later, a NaN embedding a zero vector, and NumpyChunkIndex
    ranked garbage for limit=-1 and kept NaN vectors."""
    for kw, error in (
        (dict(ngrams=(1.5,)), TypeError),
        (dict(ngrams="345"), TypeError),
        (dict(word_weight="x"), TypeError),
        (dict(word_weight=float("nan")), ValueError),
        (dict(seed=1.5), TypeError),
    ):
        with pytest.raises(error, match=next(iter(kw))):
            embed.HashedNgramEmbedder(16, **kw)
    with pytest.raises(TypeError, match="vocab_size"):
        embed.WordTokenizer(vocab_size=2.5)
    with pytest.raises(ValueError, match="offset"):
        embed.WordTokenizer(offset=1 << 40)
    assert all(isinstance(t, int) and t < 1 << 31 for t in embed.WordTokenizer((1 << 31) - 1001).encode("a b"))
    with pytest.raises(TypeError, match="dim"):
        embed.CallableEmbedder(lambda t: np.ones((len(t), 2)), 2.5)
    with pytest.raises(ValueError, match="non-finite"):
        embed.CallableEmbedder(lambda t: np.full((len(t), 2), np.nan), 2).embed(["a"])
    with pytest.raises(ValueError, match="hash:"):
        embed.open_embedder("hash:x")
    with pytest.raises(TypeError, match="dim"):
        retrieval.NumpyChunkIndex(2.5)
    idx = retrieval.NumpyChunkIndex(4)
    idx.add([1, 2], np.eye(4, dtype=np.float32)[:2])
    with pytest.raises(ValueError, match="finite"):
        idx.add([3], np.full((1, 4), np.nan))
    with pytest.raises(ValueError, match="limit"):
        idx.search(np.ones(4), -1)
    with pytest.raises(TypeError, match="limit"):
        idx.search(np.ones(4), 1.5)
    assert len(idx) == 2 and [i for i, _ in idx.search(np.array([1.0, 0.2, 0, 0]), 2)] == [1, 2]


def test_add_document_chunks_text(corpus):
    text = " ".join(corpus.chunks[0].words + corpus.chunks[1].words)
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy") as r:
        recs = r.add_document("doc-a", text, chunk_tokens=48)
        assert [x.n_tokens for x in recs] == [48, 48, 32] and [x.index for x in recs] == [0, 1, 2]
        assert all(x.doc == "doc-a" for x in recs)
        assert recs[0].text.split() == corpus.chunks[0].words[:48]

        class Tok:  # a model tokenizer: encode / decode
            def encode(self, s):
                return [ord(ch) for ch in s]

            def decode(self, ids):
                return "".join(map(chr, ids))

        recs = r.add_document("doc-b", "abcdefghij" * 5, chunk_tokens=32, tokenizer=Tok())
        assert [x.n_tokens for x in recs] == [32, 18] and recs[1].text == ("abcdefghij" * 5)[32:]


def test_failed_add_leaves_nothing_behind_and_a_retry_indexes(corpus):
    inner = embed.HashedNgramEmbedder(256)
    outage = [1]

    def flaky(texts):  # an embedding service that fails once
        if outage[0]:
            outage[0] -= 1
            raise ConnectionError("embedding service unavailable")
        return inner.embed(texts)

    items = _items(corpus)[:4]
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy", embedder=embed.CallableEmbedder(flaky, 256)) as r:
        with pytest.raises(ConnectionError):
            r.add_chunks(items)
        assert len(r) == 0 and len(r.index) == 0
        recs = r.add_chunks(items)
        assert len(r) == 4 and len(r.index) == 4
        assert r.predict(corpus.chunks[2].text, k=1)[0].chunk_id == recs[2].chunk_id

    with _engine() as eng:
        kv, calls = SyntheticKV(eng), [0]

        def kv_fn(seq, tokens):  # a prefill failing on the third chunk
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("prefill failed")
            kv(seq, tokens)

        with SpeculativeRetriever(eng, index="numpy", kv_fn=kv_fn) as r:
            with pytest.raises(RuntimeError, match="prefill failed"):
                r.add_chunks(items)
            assert len(r) == 0 and len(r.index) == 0
            recs = r.add_chunks(items)
            assert len(r) == 4 and len(r.index) == 4
            assert r.predict(corpus.chunks[0].text, k=1)[0].chunk_id == recs[0].chunk_id


def test_add_document_past_the_room_frees_what_it_added():
    big = bench_retriever.make_corpus(4, 4, 2, CHUNK_TOKENS, seed=3)  # 128 blocks > the 96 of the engine
    words = [w for c in big.chunks for w in c.words]
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy") as r:
        with pytest.raises(kvh.NoSpaceError):
            r.add_document("manual", " ".join(words), chunk_tokens=CHUNK_TOKENS)
        assert len(r) == 0 and len(r.index) == 0
        recs = r.add_document("manual", " ".join(words[: 20 * CHUNK_TOKENS]), chunk_tokens=CHUNK_TOKENS)
        assert len(recs) == 20 and len(r.index) == 20


@needs_qdrant
def test_failed_upsert_is_retried(corpus):
    with _engine() as eng, SpeculativeRetriever(eng) as r:
        add, fails = r.index.add, [1]

        def failing_add(ids, vectors, payloads=None):
            if fails[0]:
                fails[0] -= 1
                raise RuntimeError("upsert failed")
            add(ids, vectors, payloads)

        r.index.add = failing_add
        with pytest.raises(RuntimeError, match="upsert failed"):
            r.add_chunks(_items(corpus)[:3])
        assert len(r) == 0 and r.index.count() == 0
        recs = r.add_chunks(_items(corpus)[:3])
        assert len(r) == 3 and r.index.count() == 3
        assert r.predict(corpus.chunks[1].text, k=1)[0].chunk_id == recs[1].chunk_id


@pytest.mark.parametrize("kind", ["numpy", pytest.param("qdrant", marks=needs_qdrant)])
def test_a_chunk_added_by_two_agents_is_found_by_both(tmp_path, corpus, kind):
    t, text = corpus.tokens(3), corpus.chunks[3].text
    kw = {"index": "numpy"} if kind == "numpy" else {"qdrant_path": str(tmp_path / "q")}

    def found(r, agent):
        return cid in [p.chunk_id for p in r.predict(text, agent=agent)]

    with _engine() as eng, SpeculativeRetriever(eng, filter_agents=True, **kw) as r:
        cid = r.add_chunk(t, text, agent=1).chunk_id
        assert r.add_chunk(t, text, agent=2) is r.record(cid)
        assert r.record(cid).agents == [1, 2]
        wider = retriever.ChunkRecord(cid, t, text, agent=2, agents=[2, 1])
        assert (
            retriever.ChunkRecord.from_payload(cid, wider.payload(model_salt=0, block_tokens=16, embedder="e")) == wider
        )
        assert found(r, 1) and found(r, 2) and not found(r, 3)
        r.add_chunk(t, text)  # added for everyone
        assert r.record(cid).agents == [] and r.record(cid).agent is None and found(r, 3)
    if kind == "qdrant":
        with _engine() as eng, SpeculativeRetriever(eng, filter_agents=True, **kw) as r:
            r.load()
            assert r.record(cid).agents == [] and found(r, 3)


@needs_qdrant
def test_load_leaves_out_points_of_another_embedder(tmp_path, corpus):
    q = str(tmp_path / "q")
    with _engine() as eng, SpeculativeRetriever(eng, qdrant_path=q, embedder="hash:256") as r:
        ids = [x.chunk_id for x in r.add_chunks(_items(corpus))]
    other = embed.HashedNgramEmbedder(256, ngrams=(2, 3), seed=7)  # same width, other vectors
    with _engine() as eng, SpeculativeRetriever(eng, qdrant_path=q, embedder=other, top_k=1) as r:
        assert r.load() == 0 and r.skipped_points == len(ids)
        assert r.predict(corpus.chunks[0].text) == []
        assert r.skipped_points == len(ids)  # distinct points, not meetings
        r.add_chunks(_items(corpus))  # re-embedded by this embedder
        assert r.index.get([ids[0]])[ids[0]]["embedder"] == other.name
        assert all(r.predict(c.text)[0].chunk_id == ids[i] for i, c in enumerate(corpus.chunks))


@needs_qdrant
def test_load_skips_malformed_points_and_ids_that_are_not_the_tokens(tmp_path, corpus):
    q = str(tmp_path / "q")
    with _engine() as eng, SpeculativeRetriever(eng, qdrant_path=q) as r:
        recs = r.add_chunks(_items(corpus)[:4])
        good = r.index.get([recs[0].chunk_id])[recs[0].chunk_id]
        bad = dict(good, block_hashes=["not-hex"])
        huge = dict(good, tokens=[1 << 40] * 4)
        fake = dict(good, tokens=[int(t) for t in corpus.tokens(9)])  # another chunk's tokens
        vecs = r.embedder.embed([corpus.chunks[0].text + " draft"] * 3)
        r.index.add([0xBAD, 0xB16, 0xF00], vecs, [bad, huge, fake])
    with _engine() as eng, SpeculativeRetriever(eng, qdrant_path=q, top_k=3) as r:
        assert r.load() == 4 and r.skipped_points == 3
        hits = [p.chunk_id for p in r.prefetch(corpus.chunks[0].text, agent=1).predictions]
        assert hits[0] == recs[0].chunk_id and not {0xBAD, 0xB16, 0xF00} & set(hits)
    with _engine() as eng, SpeculativeRetriever(eng, qdrant_path=q, top_k=4) as r:  # no load: found by search
        hits = [p.chunk_id for p in r.predict(corpus.chunks[0].text)]
        assert hits[0] == recs[0].chunk_id and not {0xBAD, 0xB16, 0xF00} & set(hits)


@needs_qdrant
def test_a_chunk_shorter_than_a_block_survives_a_new_block_size(tmp_path, corpus):
    q, short = str(tmp_path / "q"), corpus.tokens(0)[:12]
    bt32 = dict(block_tokens=32, device_bytes=32 * 8192, host_bytes=64 * 8192)
    with _engine() as eng, SpeculativeRetriever(eng, qdrant_path=q) as r:
        old = r.add_chunk(short, "short heading").chunk_id
    with _engine(**bt32) as eng, SpeculativeRetriever(eng, qdrant_path=q) as r:
        cid = r.add_chunk(short, "short heading").chunk_id
        assert cid != old and r.index.get([cid])[cid]["block_tokens"] == 32
    with _engine(**bt32) as eng, SpeculativeRetriever(eng, qdrant_path=q, top_k=1) as r:
        assert r.load() == 1 and r.chunk_ids == [cid]
        assert r.predict("short heading")[0].chunk_id == cid


@pytest.mark.parametrize(
    "bad",
    [
        {"k": 0},
        {"context": b"bytes"},
        {"draft_text": 5},
        {"agent": 1.5},
        {"agent": "z"},
    ],
)
def test_a_rejected_prefetch_leaves_the_accounting_alone(corpus, bad):
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy", top_k=2) as r:
        r.add_chunks(_items(corpus))
        res = r.prefetch(corpus.chunks[0].text, agent=1)
        kw = {key: v for key, v in bad.items() if key != "context"}
        for call in (r.prefetch, r.prefetch_async, r.predict):
            with pytest.raises((TypeError, ValueError)):
                call(bad.get("context", "some words"), **{"agent": 1, **kw})
        r.note_use(res.chunk_ids[0], agent=1)
        r.end_windows()
        m = r.metrics()
        assert (m.windows, m.predicted, m.used, m.hits, m.predictions) == (1, 2, 1, 1, 1)
        with pytest.raises(TypeError, match="agent"):
            r.note_use(res.chunk_ids[0], agent="z")


def test_base_priority_must_leave_room_for_every_rank(corpus):
    with _engine() as eng:
        with pytest.raises(ValueError, match="base_priority"):
            SpeculativeRetriever(eng, index="numpy", top_k=4, base_priority=-(2**31))
        low = -(2**31) + 3
        with SpeculativeRetriever(eng, index="numpy", top_k=4, base_priority=low) as r:
            r.add_chunks(_items(corpus))
            for cid in r.chunk_ids:
                r.sequence(cid).migrate(Tier.HOST)
            assert len(r.prefetch(corpus.chunks[0].text).hinted) == 4
            res = r.prefetch(corpus.chunks[1].text, k=6)  # past top_k: the lowest priority
            assert len(res.hinted) + len(res.resident) == 6


def _slow_embedder(pause):
    inner = embed.HashedNgramEmbedder(256)

    def fn(texts):
        time.sleep(pause[0])
        return inner.embed(texts)

    return embed.CallableEmbedder(fn, 256, name="slow")


def test_drain_timeout_is_one_deadline(corpus):
    pause = [0.0]
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy", embedder=_slow_embedder(pause)) as r:
        r.add_chunks(_items(corpus)[:4])
        pause[0] = 0.3
        futs = [r.prefetch_async("abc def", agent=1) for _ in range(5)]
        t0 = time.monotonic()
        assert r.drain(timeout=0.05) is False
        assert time.monotonic() - t0 < 0.25  # not 0.05 s per queued prediction
        for bad, error in (("x", TypeError), (1j, TypeError), (float("nan"), ValueError)):
            with pytest.raises(error, match="timeout"):
                r.drain(bad)
        t0 = time.monotonic()
        assert r.drain(-1) is False and r.drain(-math.inf) is False  # a poll, as PrefetchResult.wait(-1)
        assert time.monotonic() - t0 < 0.2
        pause[0] = 0.0
        for f in futs[1:]:
            f.cancel()
        assert r.drain(math.inf) is True  # no limit
        assert r.drain(-1) is True and r.drain() is True


def _predictions_queued_behind_a_running_one(r, corpus, n):
    """n background predictions, returned once the first is running."""
    futs = [r.prefetch_async(corpus.chunks[i].text, agent=1) for i in range(n)]
    deadline = time.monotonic() + 5
    while not futs[0].running() and time.monotonic() < deadline:
        time.sleep(0.005)
    return futs


def _slow_retriever(eng, corpus, seconds):
    """A retriever holding 4 chunks whose embedder then takes `seconds` a call."""
    pause = [0.0]
    r = SpeculativeRetriever(eng, index="numpy", embedder=_slow_embedder(pause))
    r.add_chunks(_items(corpus)[:4])
    pause[0] = seconds
    return r


def test_close_cancels_queued_predictions_and_waits_for_the_running_one(corpus):
    from concurrent.futures import CancelledError

    with _engine() as eng:
        r = _slow_retriever(eng, corpus, 0.25)
        futs = _predictions_queued_behind_a_running_one(r, corpus, 6)
        t0 = time.monotonic()
        r.close()
        assert time.monotonic() - t0 < 0.8  # not 6 x 0.25 s
        assert futs[0].done() and not futs[0].cancelled()
        for f in futs[1:]:
            with pytest.raises(CancelledError):
                f.result(0)


def test_drain_and_metrics_return_after_close_cancelled_predictions(corpus):
    with _engine() as eng:
        r = _slow_retriever(eng, corpus, 0.2)
        futs = _predictions_queued_behind_a_running_one(r, corpus, 3)
        r.close()
        assert futs[-1].cancelled()
        t0 = time.monotonic()
        assert r.drain(2.0) is True  # cancelled counts as done
        assert time.monotonic() - t0 < 1.0
        done = threading.Event()
        t = threading.Thread(target=lambda: (r.metrics(), r.reset_metrics(), r.drain(), done.set()), daemon=True)
        t.start()
        t.join(5)
        assert done.is_set()


@needs_qdrant
def test_resident_is_a_query(tmp_path, corpus):
    q = str(tmp_path / "q")
    with _engine() as eng, SpeculativeRetriever(eng, qdrant_path=q) as r:
        ids = [x.chunk_id for x in r.add_chunks(_items(corpus)[:4])]
    with _engine() as eng:  # a restart: the KV is gone (no disk tier)
        kv, calls = SyntheticKV(eng), [0]

        def counting_kv(seq, tokens):
            calls[0] += 1
            kv(seq, tokens)

        with SpeculativeRetriever(eng, qdrant_path=q, kv_fn=counting_kv) as r:
            assert r.load() == 4
            assert [r.resident(c) for c in ids] == [False] * 4
            assert calls[0] == 0 and r.computed_tokens == 0 and eng.tier_info(Tier.DEVICE).used_blocks == 0
            with pytest.raises(KeyError):
                r.resident(12345)
            r.sequence(ids[0])
            assert r.resident(ids[0]) and calls[0] == 1


@needs_qdrant
def test_meta_survives_a_restart_whatever_its_keys(tmp_path, corpus):
    q = str(tmp_path / "q")
    meta = {"doc": "upstream-42", "agent": "crawler", "text": "original HTML", "index": 17, "lang": "en"}
    with _engine() as eng, SpeculativeRetriever(eng, qdrant_path=q) as r:
        rec = r.add_chunk(corpus.tokens(0), corpus.chunks[0].text, doc="manual", agent=3, meta=meta)
        old = dict(rec.payload(model_salt=r.model_salt, block_tokens=16, embedder=r.embedder.name), lang="de")
        old.pop("meta")  # a payload written when meta was merged into the top level
        r.index.add(
            [r.content_id(corpus.tokens(1))],
            r.embedder.embed(["x"]),
            [dict(old, tokens=[int(t) for t in corpus.tokens(1)])],
        )
    with _engine() as eng, SpeculativeRetriever(eng, qdrant_path=q) as r:
        assert r.load() == 2
        back = r.record(rec.chunk_id)
        assert back.meta == meta and back.doc == "manual" and back.agent == 3 and back.text == corpus.chunks[0].text
        assert r.record(r.content_id(corpus.tokens(1))).meta == {"lang": "de"}


@pytest.mark.parametrize("kind", ["numpy", pytest.param("qdrant", marks=needs_qdrant)])
def test_numpy_scalars_in_a_chunk_become_python_values(tmp_path, corpus, kind):
    kw = {"index": "numpy"} if kind == "numpy" else {"qdrant_path": str(tmp_path / "q")}
    with _engine() as eng, SpeculativeRetriever(eng, **kw) as r:
        meta = {"page": np.int32(7), "score": np.float64(0.5), "span": np.arange(2)}
        rec = r.add_chunk(corpus.tokens(0), "x", doc=np.str_("d"), index=np.int64(2), agent=np.int64(3), meta=meta)
        assert (rec.index, rec.agent, rec.doc, rec.meta) == (2, 3, "d", {"page": 7, "score": 0.5, "span": [0, 1]})
        assert type(rec.index) is int and type(rec.meta["page"]) is int
        with pytest.raises(TypeError, match="meta must be JSON-able"):
            r.add_chunk(corpus.tokens(1), "y", meta={"when": object()})
        assert len(r) == 1
    if kind == "qdrant":
        with _engine() as eng, SpeculativeRetriever(eng, **kw) as r:
            assert r.load() == 1 and r.record(rec.chunk_id).meta == rec.meta


def test_a_tokenizer_collision_does_not_drop_a_document(caplog):
    w = embed.WordTokenizer()
    assert w.token("9989") == w.token("90246")  # the default vocabulary has collisions
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy") as r:
        first = r.add_document("invoice-2023", "Invoice total is 9989 dollars payable by wire", chunk_tokens=16)
        with pytest.raises(ValueError, match="same ids"):
            r.add_document("invoice-2024", "Invoice total is 90246 dollars payable by wire", chunk_tokens=16)
        assert len(r) == 1 and r.record(first[0].chunk_id).doc == "invoice-2023"
        assert r.add_document("invoice-2023", "Invoice total is 9989 dollars payable by wire", chunk_tokens=16) == first
        with caplog.at_level("WARNING", logger="kvh.retriever"):
            assert r.add_chunk(first[0].tokens) is first[0]  # no text given: nothing to tell
            assert "other text" not in caplog.text
            assert r.add_chunk(first[0].tokens, "another text") is first[0]
        assert "other text" in caplog.text and first[0].text.startswith("Invoice total is 9989")


@pytest.mark.parametrize("held", ["original text", "no text", "a label", "read back"])
def test_a_document_of_held_ids_in_another_form_is_no_collision(tmp_path, held):
    if held == "read back" and not retriever.qdrant_available():
        pytest.skip("qdrant-client is not installed")
    tok = embed.WordTokenizer()
    text = "Hello, world. The invoice total is 9989 dollars."
    given = {"original text": text, "no text": None, "a label": "greeting", "read back": text}[held]
    kw = {"qdrant_path": str(tmp_path / "q")} if held == "read back" else {"index": "numpy"}
    with _engine() as eng:
        r = SpeculativeRetriever(eng, **kw)
        first = r.add_chunk(tok.encode(text), given, doc="d")  # e.g. from pre-tokenized data
        if held == "read back":  # a record of the index, not loaded
            r.close()
            r = SpeculativeRetriever(eng, **kw)
        with r:
            # the same words: 'Hello, world.' is 'Hello , world .' as the document's chunk text
            assert [x.chunk_id for x in r.add_document("d", text, chunk_tokens=64)] == [first.chunk_id]
            other = text.replace("9989", "90246")  # other words of the same ids
            if given == text:
                with pytest.raises(ValueError, match="same ids"):
                    r.add_document("e", other, chunk_tokens=64)
            else:  # a held text that is not its tokens' words cannot tell
                assert [x.chunk_id for x in r.add_document("e", other, chunk_tokens=64)] == [first.chunk_id]
            assert len(r) == 1


@needs_qdrant
def test_a_qdrant_path_that_cannot_be_a_store_is_a_runtime_error(tmp_path):
    (tmp_path / "file").write_text("")
    with _engine() as eng:
        for path in (str(tmp_path / "file"), ""):
            with pytest.raises(RuntimeError, match="cannot open the embedded Qdrant store"):
                SpeculativeRetriever(eng, qdrant_path=path)


def test_chunk_arguments_and_records_are_checked(corpus):
    class Nameless:
        dim = 64

        def embed(self, texts):
            return embed.HashedNgramEmbedder(64).embed(texts)

    with _engine() as eng:
        with pytest.raises(TypeError, match="name"):
            SpeculativeRetriever(eng, index="numpy", embedder=Nameless())
        with SpeculativeRetriever(eng, index="numpy") as r:
            with pytest.raises(TypeError, match="text must be str"):
                r.add_chunk(corpus.tokens(0), b"bytes")
            with pytest.raises(ValueError, match="UTF-8"):
                r.add_chunk(corpus.tokens(0), "\ud800x")
            assert len(r) == 0 and len(r.index) == 0
            rec = r.add_chunk(corpus.tokens(0), "x", meta={"a": 1})
            again = retriever.ChunkRecord.from_payload(
                rec.chunk_id, rec.payload(model_salt=r.model_salt, block_tokens=16, embedder="e")
            )
            assert rec == again and again in [rec]
            assert rec != retriever.ChunkRecord(rec.chunk_id, rec.tokens[:-1], "x", meta={"a": 1})
            r.sequence(rec.chunk_id).migrate(Tier.HOST)
            res = r.prefetch("x", k=1)
            assert res.hinted == [rec.chunk_id]
            res.close()
            with pytest.raises(kvh.ClosedError):
                res.wait(5)


def test_open_embedder_dim_must_agree():
    assert embed.open_embedder("hash:128").dim == 128 and embed.open_embedder("hash", dim=64).dim == 64
    assert embed.open_embedder("hash:64", dim=64).dim == 64
    with pytest.raises(ValueError, match="dim=64"):
        embed.open_embedder("hash:128", dim=64)
    with pytest.raises(ValueError, match="dim"):
        embed.open_embedder("hash", dim=0)


def test_numpy_index_checks_ids_queries_and_closing():
    idx = retrieval.NumpyChunkIndex(4)
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError, match="id"):
            idx.add([bad], np.ones((1, 4)))
    idx.add([1], np.ones((1, 4)))
    assert idx.search(np.zeros(4), 2) == []
    with pytest.raises(ValueError, match="finite"):
        idx.search(np.full(4, np.nan), 2)
    idx.close()
    with pytest.raises(kvh.ClosedError, match="closed"):
        idx.add([2], np.ones((1, 4)))
    with pytest.raises(kvh.ClosedError, match="closed"):
        idx.search(np.ones(4), 2)


@needs_qdrant
def test_add_chunks_asks_the_index_once_per_call():
    c = bench_retriever.make_corpus(2, 2, 5, 32, seed=9)  # 20 chunks
    its = [{"tokens": c.tokens(i), "text": ch.text} for i, ch in enumerate(c.chunks)]
    with _engine(device_bytes=64 * 4096, host_bytes=128 * 4096) as eng, SpeculativeRetriever(eng, index="qdrant") as r:
        calls = []
        for name in ("get", "has"):
            orig = getattr(r.index, name)
            setattr(r.index, name, lambda ids, _o=orig, _n=name: (calls.append(_n), _o(ids))[1])
        recs = r.add_chunks(its)
        assert len(r) == len(its) and calls == ["get"]  # not one get per new chunk
        calls.clear()
        assert r.add_chunks(its + [dict(its[0], agent=3)]) == recs + [recs[0]]
        assert len(calls) <= 1


def test_an_add_that_a_close_overtakes_raises_closed_error(corpus):
    with _engine() as eng:
        r = SpeculativeRetriever(eng, index="numpy")
        add = r.index.add

        def closing_add(*a, **k):  # close() runs between the KV and the upsert
            r.close()
            return add(*a, **k)

        r.index.add = closing_add
        with pytest.raises(kvh.ClosedError, match="retriever is closed"):
            r.add_chunks(_items(corpus)[:2])
        assert len(r) == 0


def test_concurrent_adds_of_one_chunk_get_one_record(corpus):
    with _engine() as eng:
        kv, started = SyntheticKV(eng), threading.Event()

        def slow_kv(seq, tokens):  # a prefill long enough for a second add to arrive
            started.set()
            time.sleep(0.2)
            kv(seq, tokens)

        with SpeculativeRetriever(eng, index="numpy", kv_fn=slow_kv) as r:
            out = [None, None]

            def add(k):
                out[k] = r.add_chunk(corpus.tokens(0), corpus.chunks[0].text, agent=k + 1)

            first = threading.Thread(target=add, args=(0,))
            first.start()
            assert started.wait(5)
            add(1)
            first.join()
            assert out[0] is out[1] is r.record(out[0].chunk_id)
            assert out[0].agent == 1 and out[0].agents == [1, 2]
            assert r.computed_tokens == CHUNK_TOKENS


# ---------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------
def test_bench_trace_is_deterministic():
    c = bench_retriever.make_corpus(4, 2, 3, 32, seed=2)
    assert len(c.chunks) == 24 and all(len(x.words) == 32 for x in c.chunks)
    assert bench_retriever.make_corpus(4, 2, 3, 32, seed=2).chunks[5].words == c.chunks[5].words
    t1 = bench_retriever.make_trace(c, 3, 10, seed=2)
    t2 = bench_retriever.make_trace(c, 3, 10, seed=2)
    assert [[s.needs for s in a] for a in t1] == [[s.needs for s in a] for a in t2]
    assert all(1 <= len(s.needs) <= 2 for a in t1 for s in a)
    topics = {c.chunks[s.needs[0]].topic for a in t1 for s in a}
    assert len(topics) > 1  # agents move between topics


def test_bench_quick_numpy_in_process():
    args = bench_retriever.build_parser().parse_args(
        ["--quick", "--index", "numpy", "--modes", "speculative,no_prefetch"]
    )
    rows, ok, notes = bench_retriever.run_bench(args)
    assert ok, notes
    by = {(r["metric"], r["mode"], r.get("baseline_mode")): r for r in rows}
    stall = by[("acquire_stall", "speculative", "no_prefetch")]
    assert stall["index"] == "numpy" and stall["unit"] == "ms" and "ratio" in stall and "met" in stall
    assert 0 <= by[("prefetch_recall", "speculative", None)]["value"] <= 1


def test_bench_help_and_usage():
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    res = subprocess.run(
        [sys.executable, "-m", "kvh_cache.demo.bench_retriever", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 0 and "--quick" in res.stdout and "naive_sync" in res.stdout
    assert bench_retriever.main(["--agents", "0"], out=open(os.devnull, "w")) == 2
    assert bench_retriever.main(["--modes", "fast"], out=open(os.devnull, "w")) == 2


@needs_qdrant
def test_bench_quick_json_subprocess():
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    res = subprocess.run(
        [sys.executable, "-m", "kvh_cache.demo.bench_retriever", "--quick", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    assert rows and all({"scenario", "metric", "value", "unit"} <= set(r) for r in rows)
    assert {r["scenario"] for r in rows} == {"retriever"}
    assert {r["mode"] for r in rows} == set(bench_retriever.MODES)
    assert rows[0]["index"] == "qdrant-local"
    stall = [r for r in rows if r["metric"] == "acquire_stall" and r["mode"] == "speculative"]
    assert {r["baseline_mode"] for r in stall} == {"no_prefetch", "naive_sync"}
    for r in stall:
        assert r["baseline"] > 0 and r["ratio"] == pytest.approx(r["baseline"] / r["value"], rel=1e-3)
    frac = [r for r in rows if r["metric"] == "stall_fraction" and r["mode"] == "speculative"][0]
    assert frac["target"] == "value <= 0.25" and isinstance(frac["met"], bool)
    counters = {r["metric"]: r["value"] for r in rows if r["mode"] == "speculative" and r["unit"] == "blocks"}
    assert counters["prefetch_issued"] > 0
    assert (
        counters["prefetch_useful"] + counters["prefetch_wasted"] + counters["prefetch_late"]
        <= counters["prefetch_issued"]
    )


def test_a_closed_engine_refuses_predict_and_prefetch(corpus):
    """predict went on answering after the engine closed, naming chunks
    whose KV no one could acquire any more, while prefetch and acquire
    raised ClosedError."""
    eng = _engine()
    with SpeculativeRetriever(eng, index="numpy") as r:
        r.add_chunks(_items(corpus)[:4])
        assert r.predict(corpus.chunks[0].text)
        eng.close()
        for call in (lambda: r.predict(corpus.chunks[0].text), lambda: r.prefetch(corpus.chunks[0].text)):
            with pytest.raises(kvh.ClosedError, match="engine is closed"):
                call()


def test_note_use_on_a_closed_retriever_raises_closed_error(corpus):
    with _engine() as eng:
        r = SpeculativeRetriever(eng, index="numpy")
        cid = r.add_chunks(_items(corpus)[:1])[0].chunk_id
        r.close()
        with pytest.raises(kvh.ClosedError, match="retriever is closed"):
            r.note_use(cid)


def test_a_closed_caller_index_raises_closed_error(corpus):
    """A NumpyChunkIndex the caller closed raised a plain RuntimeError from
    the retriever's calls, unlike every other closed object of kvh."""
    with _engine() as eng:
        index = retrieval.NumpyChunkIndex(embed.open_embedder("auto").dim)
        with SpeculativeRetriever(eng, index=index) as r:
            r.add_chunks(_items(corpus)[:2])
            index.close()
            calls = [
                lambda: r.predict(corpus.chunks[0].text),
                lambda: r.prefetch(corpus.chunks[0].text),
                lambda: r.add_document("doc", corpus.chunks[3].text),
            ]
            for call in calls:
                with pytest.raises(kvh.ClosedError, match="NumPy chunk index is closed"):
                    call()


@needs_qdrant
def test_a_closed_qdrant_index_raises_closed_error():
    index = retriever.open_chunk_index("qdrant", 8)
    index.close()
    with pytest.raises(kvh.ClosedError, match="Qdrant chunk index is closed"):
        index.search(np.ones(8, np.float32), 2)


def test_a_top_k_past_the_default_priority_names_top_k():
    """top_k=2**32-1 was refused as "base_priority must be in [2147483646,
    ...], got 1000": a parameter the caller never set, and no word of
    top_k."""
    with _engine() as eng:
        with pytest.raises(ValueError, match=r"top_k must be at most 2147484649\b"):
            SpeculativeRetriever(eng, index="numpy", top_k=2**32 - 1)
        with SpeculativeRetriever(eng, index="numpy", top_k=2**31 + 1000) as r:  # the largest the default allows
            assert r.top_k == 2**31 + 1000


# ---------------------------------------------------------------------------------
# calls from a prediction's done callback, rejected queries, index checks
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("call", ["metrics", "close"])
def test_calls_from_a_done_callback_neither_hang_nor_half_close(corpus, call):
    """A done callback runs on the retriever's one worker: metrics() (via
    drain) waited there for a queued prediction only that thread could
    run, for good, and close() raised "cannot join current thread" with
    the retriever marked closed and its sequences never freed."""
    import threading

    with _engine() as eng:
        r = SpeculativeRetriever(eng, index="numpy", top_k=2)
        r.add_chunks(_items(corpus))
        gate, outcome, called = threading.Event(), [], threading.Event()

        def on_done(_):
            try:
                getattr(r, call)()
                outcome.append("ok")
            except Exception as exc:  # noqa: BLE001 - the test reports it
                outcome.append(f"{type(exc).__name__}: {exc}")
            called.set()

        r.draft = lambda text: (gate.wait(10), "")[1]  # the first prediction runs until both are queued
        first = r.prefetch_async(corpus.chunks[0].text, agent=1)
        first.add_done_callback(on_done)
        r.prefetch_async(corpus.chunks[1].text, agent=2)
        gate.set()
        assert called.wait(20), "the callback never returned"
        assert outcome == ["ok"], outcome
        closer = threading.Thread(target=r.close)
        closer.start()
        closer.join(20)
        assert not closer.is_alive(), "close() from another thread hangs"
        assert not r._seqs


def test_a_rejected_query_leaves_the_accounting_as_it_was(corpus):
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy", top_k=2) as r:
        recs = r.add_chunks(_items(corpus))
        res = r.prefetch(corpus.chunks[2].text, agent=1)
        # A lone surrogate failed in the embedder, after the next window had
        # opened: the agent's use below landed in an empty window.
        with pytest.raises(ValueError, match="not valid text"):
            r.prefetch("next \ud800", agent=1)
        with pytest.raises(ValueError, match="not valid text"):
            r.prefetch("ok", agent=1, draft_text="\udfff")
        r.note_use([recs[2].chunk_id], agent=1)
        r.end_windows()
        m = r.metrics()
        assert m.windows == 1 and m.hits == 1 and recs[2].chunk_id in res.chunk_ids, m
        with pytest.raises(TypeError, match="chunk_ids must be"):
            r.note_use(5.0, agent=1)


@pytest.mark.parametrize("kind", ["numpy", "qdrant"])
def test_both_indexes_check_a_search_alike(kind):
    index = retrieval.NumpyChunkIndex(4) if kind == "numpy" else retriever.open_chunk_index("qdrant", 4)
    try:
        index.add([1, 2], np.eye(4, dtype=np.float32)[:2], [{"agent": 1}, {}])
        with pytest.raises(ValueError, match="finite"):
            index.search(np.array([np.inf, 0, 0, 0], np.float32), 2)
        for bad_limit, exc in ((1.5, TypeError), (True, TypeError), (-1, ValueError), ("2", TypeError)):
            with pytest.raises(exc):
                index.search(np.eye(4, dtype=np.float32)[0], bad_limit)
        with pytest.raises(TypeError):
            index.search(np.eye(4, dtype=np.float32)[0], 2, agent=1.5)
        assert [pid for pid, _ in index.search(np.eye(4, dtype=np.float32)[0], 2, agent=1)][0] == 1
    finally:
        index.close()


def test_auto_index_fallback_is_said(tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with caplog.at_level("WARNING", logger="kvh"):
        index = retrieval.open_chunk_index("auto", 8, path=str(not_a_dir))
    try:
        assert isinstance(index, retrieval.NumpyChunkIndex)
        assert any("keeps nothing across restarts" in r.getMessage() for r in caplog.records)
    finally:
        index.close()


def test_another_retrievers_worker_is_not_taken_for_its_own(corpus):
    """A retriever took any thread named like a retriever worker for its
    own: after a synchronous prefetch run on another retriever's worker,
    its drain() there would not wait for its own queued predictions."""
    import threading

    with _engine() as eng:
        a = SpeculativeRetriever(eng, index="numpy", top_k=2)
        b = SpeculativeRetriever(eng, index="numpy", top_k=2)
        a.add_chunks(_items(corpus))
        b.add_chunks(_items(corpus))
        seen, called = [], threading.Event()

        def on_done(_):
            b.prefetch(corpus.chunks[0].text, agent=1)  # b's sync call, on a's worker
            seen.append((a._on_worker(), b._on_worker()))
            called.set()

        a.prefetch_async(corpus.chunks[2].text, agent=0).add_done_callback(on_done)
        assert called.wait(30)
        assert seen == [(True, False)], seen
        a.close()
        b.close()


def test_note_use_of_an_unknown_chunk_raises_and_records_nothing(corpus):
    """An id the retriever never stored was counted as a use, lowering
    recall by a chunk no prediction could have named."""
    with _engine() as eng, SpeculativeRetriever(eng, index="numpy") as r:
        recs = r.add_chunks(_items(corpus)[:3])
        r.prefetch(corpus.chunks[0].text, agent=1)
        with pytest.raises(KeyError, match="unknown chunk 0x5 .and 1 more"):
            r.note_use([recs[0].chunk_id, 5, 6], agent=1)
        with pytest.raises(KeyError, match="unknown chunk"):
            r.note_use(7)  # no window: would have counted as unwindowed
        r.end_windows()
        m = r.metrics()
        assert m.used == 0 and m.unwindowed_uses == 0, m


def test_negative_context_and_segment_lengths_are_refused():
    """A negative context_chars embedded the whole context (what 0 means)."""
    with _engine() as eng:
        for name in ("context_chars", "segment_chars"):
            with pytest.raises(ValueError, match=name):
                SpeculativeRetriever(eng, index="numpy", **{name: -1})
        with SpeculativeRetriever(eng, index="numpy", context_chars=0, segment_chars=0) as r:
            texts, weights = r.query_parts("one two three")
            assert texts == ["one two three"] and weights == [1.0]


def test_metrics_after_the_engine_closed_keep_precision_and_recall(corpus):
    """metrics() raised ClosedError once the engine was closed, losing the
    quality figures the retriever itself had counted."""
    eng = _engine()
    r = SpeculativeRetriever(eng, index="numpy")
    try:
        recs = r.add_chunks(_items(corpus)[:3])
        res = r.prefetch(corpus.chunks[1].text, agent=1)
        r.note_use([recs[1].chunk_id], agent=1)
        r.end_windows()
        before = r.metrics()
        assert before.kvh and before.windows == 1
        eng.close()
        after = r.metrics()
        assert (after.windows, after.used, after.hits) == (before.windows, before.used, before.hits)
        assert after.kvh == {} and recs[1].chunk_id in res.chunk_ids
        with pytest.raises(kvh.ClosedError):
            r.reset_metrics()
        assert r.metrics().windows == 1  # the refused reset cleared nothing
    finally:
        r.close()
        eng.close()
