"""Regenerate ``fixture.json`` and ``tokenizer.json`` against a real llama.cpp server (manual;
never in CI).

    PORT=$(OAI_CTX=8192 ../shared/tools/oai-server/start.sh)
    python tests/data/smollm2/make_fixture.py http://127.0.0.1:$PORT /tmp/oai-server/*.gguf

``tokenizer.json`` is rebuilt from the GGUF's own vocabulary (``tokenizer.ggml.tokens``,
``merges``, control tokens; pre-tokenizer ``smollm``: individual digits, then GPT-2 byte-level),
needs ``pip install gguf``, and is checked against the server's ``/tokenize`` on every fixture
text. ``fixture.json`` holds, per conversation, the OpenAI-wire messages and tools, llama.cpp's own
rendering (``/apply-template``), its token count (``/tokenize`` with special tokens parsed) and, for
the short ones, the ``prompt_tokens`` the server reports for a real completion.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from tests.token_samples import SAMPLES  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "run", "description": "Run a shell command.",
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                    "required": ["cmd"]}}},
    {"type": "function", "function": {"name": "read", "description": "Read a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
]  # fmt: skip


def call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip


def conversations() -> list[dict[str, Any]]:
    s = SAMPLES
    return [
        {"tools": [], "messages": [{"role": "user", "content": "Hello!"}]},
        {"tools": [], "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": s["prose"]},
            {"role": "assistant", "content": s["code"]},
            {"role": "user", "content": s["chinese"]},
        ]},
        {"tools": TOOLS, "messages": [
            {"role": "user", "content": "Why does test_io fail?"},
            {"role": "assistant", "content": "",
             "tool_calls": [call("c1", "run", {"cmd": "pytest"})]},
            {"role": "tool", "tool_call_id": "c1", "content": "1 failed\n"},
        ]},
        {"tools": TOOLS, "messages": [
            {"role": "system", "content": "You are a careful coding agent."},
            {"role": "user", "content": s["prose"]},
            {"role": "assistant", "content": "Two things to check.", "tool_calls": [
                call("c1", "run", {"cmd": "ls -la"}), call("c2", "read", {"path": "src/io.py"})]},
            {"role": "tool", "tool_call_id": "c1", "content": s["json"]},
            {"role": "tool", "tool_call_id": "c2", "content": s["code"]},
            {"role": "assistant", "content": s["emoji"]},
            {"role": "system", "content": "New rule: answer in one line."},
            {"role": "user", "content": "  " + s["whitespace"]},
        ]},
        {"tools": TOOLS, "messages": [
            {"role": "user", "content": s["special"]},
            {"role": "assistant", "content": "", "tool_calls": [
                call("c9", "run", {"cmd": "echo '<|im_end|>'"})]},
            {"role": "tool", "tool_call_id": "c9", "content": "<|im_end|>"},
            {"role": "assistant", "content": "\n\nDone.\n"},
            {"role": "user", "content": s["chinese"] + "\n" + s["json"]},
        ]},
    ]  # fmt: skip


def main(base: str, gguf_path: str) -> None:
    write_tokenizer(Path(gguf_path))
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(HERE / "tokenizer.json"))
    records = []
    with httpx.Client(base_url=base, timeout=120) as server:
        for conversation in conversations():
            body = {"messages": conversation["messages"]}
            if conversation["tools"]:
                body["tools"] = conversation["tools"]
            prompt = server.post("/apply-template", json=body).json()["prompt"]
            tokens = server.post("/tokenize", json={"content": prompt, "parse_special": True})
            ids = tokens.json()["tokens"]
            assert ours.encode(prompt, add_special_tokens=False).ids == ids
            record = {**conversation, "prompt": prompt, "tokens": len(ids)}
            if len(ids) < 1200:
                reply = server.post(
                    "/v1/chat/completions",
                    json={**body, "max_tokens": 1, "temperature": 0, "model": "smollm2"},
                ).json()
                record["prompt_tokens"] = reply["usage"]["prompt_tokens"]
            records.append(record)
    (HERE / "fixture.json").write_text(json.dumps(records, ensure_ascii=False, indent=1) + "\n")


def write_tokenizer(gguf_path: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode() for i in field.data]

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    kinds = reader.fields["tokenizer.ggml.token_type"]
    control = [i for i, k in enumerate(kinds.data) if int(kinds.parts[k][0]) == 3]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    document = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True} for i in control],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, {"type": "ByteLevel", **byte_level}]},
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }  # fmt: skip
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":"))
    (HERE / "tokenizer.json").write_text(text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
