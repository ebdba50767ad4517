"""The hub's prompt estimate against real counts (issue 35, point 5): the same chat requests
sent to the simulator (its usage's prompt_tokens), and, given ``--gguf MODEL`` and
llama-cpp-python, counted by llama.cpp's tokenizer over the model's own chat template; for each,
the estimate's error (mean absolute, and as a share of the real count). Run::

    python -m bench.estimate                        # against the simulator
    python -m bench.estimate --gguf qwen2.5-0.5b-instruct-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx
import trio

from gateway.apis.shapes import estimate_prompt_tokens
from gateway.sim import open_sim

KEY = "sk-bench"
REQUESTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "Explain what a hash table is."},
    ],
    [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Write a haiku about the sea."},
        {
            "role": "assistant",
            "content": "Waves fold into foam, / salt wind carries gull voices, / "
            "the tide keeps its time.",
        },
        {"role": "user", "content": "Now one about mountains, please, in the same form."},
    ],
    [{"role": "user", "content": " ".join(["The quick brown fox jumps over the lazy dog."] * 20)}],
    [
        {
            "role": "user",
            "content": "def f(x):\n    return {k: v for k, v in x.items() if v}\n"
            "# what does this do?",
        }
    ],
]


def _errors(pairs: list[tuple[int, int]]) -> tuple[float, float]:
    """(mean absolute error in tokens, mean absolute error as a share of the real count)."""
    absolute = [abs(est - real) for est, real in pairs]
    share = [abs(est - real) / real for est, real in pairs if real]
    return sum(absolute) / len(absolute), sum(share) / len(share)


async def _simulator() -> list[int]:
    counts = []
    async with open_sim(require_key=KEY) as sim, httpx.AsyncClient(timeout=30) as http:
        for messages in REQUESTS:
            reply = await http.post(
                f"{sim.url}/chat/completions",
                headers={"Authorization": f"Bearer {KEY}"},
                json={"model": "sim-model", "messages": messages, "max_tokens": 1},
            )
            counts.append(int(reply.json()["usage"]["prompt_tokens"]))
    return counts


def _llama(path: str) -> list[int] | str:
    """llama.cpp's count of each request rendered by the model's chat template, or why not."""
    try:
        import jinja2
        from llama_cpp import Llama
    except ImportError as exc:
        return f"not measured: {exc}"
    model = Llama(path, vocab_only=True, verbose=False)
    template = model.metadata.get("tokenizer.chat_template")
    if not template:
        return f"not measured: {path} has no chat template"
    render = jinja2.Environment().from_string(template)
    counts = []
    for messages in REQUESTS:
        text = render.render(messages=messages, add_generation_prompt=True, bos_token="")
        counts.append(len(model.tokenize(text.encode(), add_bos=False, special=True)))
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.estimate", description=__doc__)
    parser.add_argument("--gguf", help="a GGUF model whose tokenizer and chat template count")
    args = parser.parse_args(argv)
    estimates = [estimate_prompt_tokens(json.dumps({"messages": m}).encode()) for m in REQUESTS]
    results: dict[str, Any] = {"estimate": estimates}
    results["simulator"] = trio.run(_simulator)
    if args.gguf:
        results["llama.cpp"] = _llama(args.gguf)
    print(json.dumps(results))
    for name in ("simulator", "llama.cpp"):
        counts = results.get(name)
        if isinstance(counts, list):
            tokens, share = _errors(list(zip(estimates, counts, strict=True)))
            print(f"against {name}: mean absolute error {tokens:.1f} tokens ({share:.0%})")
        elif counts is not None:
            print(f"against {name}: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
