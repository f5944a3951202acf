"""The search-agent end-to-end test's model and config: the demo's 2-layer Qwen2 (with room for
512 positions) supervised for a few hundred steps on Search-R1-format episodes of
``tests/data/search_qa.jsonl``, so that its samples search and answer; and a run config of a few
steps of EMA-PG on those questions against a retriever URL."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from megatron_empg.rollout.retriever.client import Passage
from megatron_empg.rollout.retriever.index import Bm25Index
from megatron_empg.rollout.search_agent import INFORMATION_CLOSE, INFORMATION_OPEN, format_passages
from tests.rollout.retriever_service import CORPUS
from tests.trainer.demo_runs import demo_config
from tools.make_demo_model import demo_model_config, train
from tools.make_tiny_model import char_tokenizer, tiny_hf_model

QA = Path(__file__).resolve().parents[1] / "data" / "search_qa.jsonl"
PROMPT_TEMPLATE = "Question: {prompt}\n"
MODEL_OVERRIDES = ["max_position_embeddings=512"]
TOPK = 1
MAX_OBS_TOKENS = 64


def read_qa() -> list[dict]:
    return [json.loads(line) for line in QA.read_text().splitlines() if line.strip()]


class SearchEpisodes:
    """``make_demo_model.train``'s stream: (prompt ids, response ids + eos) of episodes
    ``<search>question</search>`` + the retriever's top passage as the agent formats it +
    ``<answer>gold</answer>``, over the QA file's questions in a seeded random order."""

    def __init__(self, tokenizer, seed: int = 0) -> None:
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_id
        index = Bm25Index.from_jsonl(CORPUS)
        self.episodes = []
        for row in read_qa():
            [hits] = index.search([row["question"]], TOPK)
            passages = [Passage(document["id"], document["contents"], score) for document, score in hits]
            room = MAX_OBS_TOKENS - len(INFORMATION_OPEN) - len(INFORMATION_CLOSE)  # one token per character
            observation = INFORMATION_OPEN + format_passages(passages).strip()[:room] + INFORMATION_CLOSE
            response = f"<search>{row['question']}</search>{observation}<answer>{row['golden_answers'][0]}</answer>"
            prompt = PROMPT_TEMPLATE.format(prompt=row["question"])
            self.episodes.append((self._encode(prompt), self._encode(response) + [self.eos]))
        self.rng = random.Random(seed)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def batch(self, size: int) -> list[tuple[list[int], list[int]]]:
        return [self.rng.choice(self.episodes) for _ in range(size)]


def make_search_warm_start(out: Path, *, steps: int = 250, seed: int = 0, lr: float = 1e-3, log=lambda _: None) -> Path:
    """Train and save (HF model and tokenizer) the warm start to ``out``."""
    model_config = demo_model_config(MODEL_OVERRIDES)
    torch.manual_seed(seed)
    tokenizer = char_tokenizer(model_config.vocab_size)
    model = tiny_hf_model(model_config, seed=seed, std=0.02)
    train(model, SearchEpisodes(tokenizer, seed), steps=steps, batch_size=16, lr=lr, log=log)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def search_config(tmp: Path, name: str, warm_start: Path, retriever_url: str, steps: int = 2) -> dict:
    """A few steps of the demo recipe's EMA-PG on the QA file's questions with the search agent."""
    config = demo_config(tmp, name, warm_start, steps=steps)
    config["model_overrides"] = MODEL_OVERRIDES
    config["train"].update(prompts_per_step=4, micro_batch_size=8, max_seq_len=320)  # DP2: 1 micro-batch each
    config["rollout"].update(max_model_len=512)
    config["rollout"]["sampling"].update(n=4, max_tokens=64)
    config["rollout"]["search_agent"] = {
        "retriever_url": retriever_url,
        "topk": TOPK,
        "max_turns": 2,
        "max_obs_tokens": MAX_OBS_TOKENS,
        "timeout_s": 5.0,
        "retries": 1,
    }
    config["data"] = {
        "source": "files",
        "train_files": [str(QA)],
        "prompt_key": "question",
        "answer_key": "golden_answers",
        "prompt_template": PROMPT_TEMPLATE,
        "reward": "qa_em",
        "apply_chat_template": False,
        "max_prompt_tokens": 64,
        "seed": 0,
    }
    return config
