"""The workload of ``kvh demo``: the prompts, the agents' questions in
round-robin order, and what every configuration shares (model, prompts,
index, plan, sizing)."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence as Seq, Tuple

import numpy as np

from .corpus import Document, HashedEmbedder, open_index

__all__ = [
    "AGENT_QUESTIONS",
    "FOLLOW_UP",
    "QUESTION_FORMAT",
    "SYSTEM_PROMPT",
    "Prompts",
    "Request",
    "Workload",
    "plan_requests",
]

SYSTEM_PROMPT = (
    "You are a careful research assistant on a small team of assistants that share one library and one "
    "notebook. Your colleagues send you questions, and a search engine attaches the library article that best "
    "matches each question. The library holds short factual articles about honeybees, volcanoes, the Moon, the "
    "printing press, coral reefs, the human heart, Roman aqueducts and glaciers.\n\n"
    "When a question arrives, read the attached article first and find the sentences that answer it. Then reply "
    "with a short answer of one or two sentences that states the facts from the article directly, keeping "
    "numbers, names and dates exactly as the article gives them. Use only what the article says; if it does not "
    "say, reply that the article does not say. Do not repeat the question, do not greet anyone, and do not "
    "describe what you are doing. Write plain sentences, never lists.\n\n"
    "Your answers go into a shared notebook that the other assistants read, so be precise and consistent with "
    "them. A colleague may come back later with a follow-up question about the same article, so write clearly "
    "enough that the next answer can build on yours."
)
QUESTION_FORMAT = "{q} Answer in one sentence."
FOLLOW_UP = "Tell me one more fact from the same article."

# Each agent's questions, asked in this order (round robin over agents).
# The retriever decides which article goes with each one.
AGENT_QUESTIONS: Tuple[Tuple[str, ...], ...] = (
    (
        "How does a honeybee tell other bees where to find food?",
        "What makes some volcanoes explode?",
        "What is coral bleaching?",
        "Why does glacier ice look blue?",
    ),
    (
        "When did people first walk on the Moon?",
        "How high is the Pont du Gard?",
        "How many copies of the Gutenberg Bible were printed?",
        "Which metals did Gutenberg use for his type?",
    ),
    (
        "How did Roman aqueducts move water without pumps?",
        "How far away is the Moon?",
        "What starts each heartbeat?",
        "What are moraines?",
    ),
)


class Prompts:
    """Token ids of the prompt pieces. Pieces are encoded separately (they
    meet at newlines and control tokens) so that the ``[system][article]``
    prefix is the same token sequence in every prompt that starts with it."""

    def __init__(self, tokenizer, corpus: Seq[Document], system: str = SYSTEM_PROMPT) -> None:
        self.tok = tokenizer
        enc = self.enc
        self.system = enc("<|im_start|>system\n" + system + "<|im_end|>\n")
        self.doc_first = {d.id: enc("<|im_start|>user\nArticle: " + d.title + "\n" + d.body + "\n\n") for d in corpus}
        self.doc_more = {d.id: enc("Article: " + d.title + "\n" + d.body + "\n\n") for d in corpus}
        self.im_end = enc("<|im_end|>")

    def enc(self, s: str) -> List[int]:
        """Token ids of ``s`` (no BOS)."""
        return [int(t) for t in self.tok.encode(s, add_bos=False)]

    def question(self, q: str) -> List[int]:
        return self.enc(QUESTION_FORMAT.format(q=q) + "<|im_end|>\n<|im_start|>assistant\n")

    def prefix(self, doc: int) -> List[int]:
        return self.system + self.doc_first[doc]

    def prompt(self, docs: Seq[int], q: str) -> List[int]:
        ids = self.prefix(docs[0])
        for d in docs[1:]:
            ids = ids + self.doc_more[d]
        return ids + self.question(q)

    def follow_up(self, conversation: Seq[int], text: str = FOLLOW_UP) -> List[int]:
        """A returning agent's next turn after ``conversation`` (its prompt
        and answer, without the end-of-turn token)."""
        return (
            list(conversation)
            + self.im_end
            + self.enc("\n<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n")
        )


@dataclasses.dataclass
class Request:
    index: int
    agent: int  # 1-based
    turn: int
    question: str
    docs: List[int] = dataclasses.field(default_factory=list)  # retrieved at request time
    predicted: Optional[List[int]] = None  # hinted ahead by the speculative retriever (kvh)
    hint_tiers: Optional[Dict[str, int]] = None  # the top article's blocks by tier when the hint went out
    prompt_tokens: int = 0
    matched: int = 0  # tokens attached from the cache
    matched_tiers: Dict[str, int] = dataclasses.field(default_factory=dict)  # where those blocks were
    prefilled: int = 0
    cold_doc_tokens: int = 0  # lazy ingest: article tokens computed inside this request
    ttft_s: float = float("nan")
    itl_s: List[float] = dataclasses.field(default_factory=list)
    tokens: List[int] = dataclasses.field(default_factory=list)
    answer: str = ""
    stop: str = "length"
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0

    @property
    def itl_mean_s(self) -> float:
        return statistics.fmean(self.itl_s) if self.itl_s else float("nan")

    def to_json(self, corpus: Seq[Document]) -> Dict[str, Any]:
        return {
            "index": self.index,
            "agent": self.agent,
            "turn": self.turn,
            "question": self.question,
            "docs": [corpus[d].name for d in self.docs],
            "predicted": None if self.predicted is None else [corpus[d].name for d in self.predicted],
            "article_tiers_at_hint": self.hint_tiers,
            "prompt_tokens": self.prompt_tokens,
            "matched_tokens": self.matched,
            "matched_tiers": self.matched_tiers,
            "prefilled_tokens": self.prefilled,
            "cold_doc_tokens": self.cold_doc_tokens,
            "ttft_ms": _ms(self.ttft_s),
            "itl_ms_mean": _ms(self.itl_mean_s),
            "itl_ms": [_ms(x) for x in self.itl_s],
            "generated_tokens": len(self.tokens),
            "stop": self.stop,
            "answer": self.answer,
        }


def _ms(s: float) -> Optional[float]:
    return None if s != s else round(s * 1e3, 3)


def plan_requests(args: argparse.Namespace) -> List[Request]:
    """Round robin: turn 0 of every agent, then turn 1, ..."""
    reqs = []
    for turn in range(args.questions):
        for a in range(args.agents):
            qs = AGENT_QUESTIONS[a % len(AGENT_QUESTIONS)]
            # agents beyond the third start elsewhere in the list
            q = qs[(turn + a // len(AGENT_QUESTIONS)) % len(qs)]
            reqs.append(Request(index=len(reqs), agent=a + 1, turn=turn, question=q))
    return reqs


class Workload:
    """What every configuration shares: model, prompts, index, workload."""

    def __init__(
        self, args: argparse.Namespace, runner, corpus: List[Document], notes: List[str], data_dir: Path
    ) -> None:
        self.args = args
        self.runner = runner
        self.corpus = corpus
        self.notes = notes
        self.prompts = Prompts(runner.tokenizer, corpus)
        self.embedder = HashedEmbedder([d.text + "\n" + d.title for d in corpus])
        self.index = open_index(args, data_dir, notes)
        self.index.add(
            [d.id for d in corpus],
            np.stack([self.embedder.embed(d.text + "\n" + d.title) for d in corpus]),
            [{"doc": d.name, "title": d.title} for d in corpus],
        )
        self.index_name = getattr(self.index, "name", type(self.index).__name__)
        self.bt = runner.block_tokens
        self.block_bytes = runner.block_bytes
        self.token_bytes = self.block_bytes // self.bt
        self.stops = set(int(t) for t in runner.tokenizer.stop_ids)
        # retrieval is deterministic: resolve the plan once for sizing
        self.plan = plan_requests(args)
        for r in self.plan:
            r.docs = self.retrieve(r.question)
        self.system_full_blocks = len(self.prompts.system) // self.bt

    def retrieve(self, question: str) -> List[int]:
        hits = self.index.search(self.embedder.embed(question), self.args.docs_per_question)
        return [int(cid) for cid, _ in hits]

    def docs_in_run(self) -> List[int]:
        if self.args.ingest == "all":
            return [d.id for d in self.corpus]
        return sorted({r.docs[0] for r in self.plan})

    # ---- sizing ----
    def kv_blocks(self) -> Dict[str, int]:
        bt = self.bt
        sys_len = len(self.prompts.system)
        s_full = sys_len // bt
        owner = -(-sys_len // bt)
        docs = sum(-(-len(self.prompts.prefix(d)) // bt) - s_full for d in self.docs_in_run())
        threads, max_req, max_doc = 0, 0, 0
        for r in self.plan:
            n = len(self.prompts.prompt(r.docs, r.question)) + self.args.gen_tokens
            shared = len(self.prompts.prefix(r.docs[0])) // bt
            threads += -(-n // bt) - shared
            max_req = max(max_req, -(-n // bt))
        for d in self.docs_in_run():
            max_doc = max(max_doc, -(-len(self.prompts.prefix(d)) // bt) - s_full)
        return {
            "total": owner + docs + threads,
            "system_full": s_full,
            "max_request": max_req,
            "max_doc": max_doc,
            "docs": docs,
            "threads": threads,
            "owner": owner,
        }
