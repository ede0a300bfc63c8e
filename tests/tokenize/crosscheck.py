#!/usr/bin/env python3
"""Cross-check the gateway's tokenization against Python, built the way vLLM builds prompts.

    python tests/tokenize/crosscheck.py path/to/switchyard

For each chat template (the tiny model's, Llama 3.1, Qwen2.5, a content-parts
template) it makes a model directory from the tiny tokenizer fixture (plus the
template family's special tokens), then for each request in requests.json
computes the prompt tokens as vLLM does — messages normalised like
`vllm.entrypoints.chat_utils.parse_chat_messages`, rendered with jinja2 in the
environment of `transformers`' `apply_chat_template` (trim_blocks, lstrip_blocks,
loopcontrols, its `tojson`, `raise_exception`), encoded with the Python
`tokenizers` with `add_special_tokens=False` for chat and `True` for completions
— and compares with `switchyard tokenize`. Any difference fails with both sides.
Needs only `tokenizers` and `jinja2` (no transformers, no torch).
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import tempfile
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TINY = ROOT / "tests/fixtures/tiny-tokenizer"
TEMPLATES = ROOT / "tests/fixtures/chat-templates"


def long_text() -> str:
    """~30 kB of real text: a stdlib module's source."""
    return (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8")[:30000]


# ---- the template environment of transformers' apply_chat_template ----
def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# ---- vLLM's content-format detection (jinja2 AST) ----
def content_format(env: jinja2.Environment, source: str) -> str:
    ast = env.parse(source)

    def names_from(node, names):
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
            node = node.node
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        return isinstance(node, jinja2.nodes.Name) and node.name in names

    lists = {"messages"}
    for a in ast.find_all(jinja2.nodes.Assign):
        if names_from(a.node, lists) and isinstance(a.target, jinja2.nodes.Name):
            lists.add(a.target.name)
    items = {f.target.name for f in ast.find_all(jinja2.nodes.For) if names_from(f.iter, lists)}
    for f in ast.find_all(jinja2.nodes.For):
        it = f.iter
        while isinstance(it, jinja2.nodes.Filter):
            it = it.node
        if isinstance(it, jinja2.nodes.Getitem) and isinstance(it.node, jinja2.nodes.Name):
            if it.node.name in items and isinstance(it.arg, jinja2.nodes.Const) and it.arg.value == "content":
                return "openai"
        if isinstance(it, jinja2.nodes.Getattr) and isinstance(it.node, jinja2.nodes.Name):
            if it.node.name in items and it.attr == "content":
                return "openai"
    return "string"


# ---- vLLM's parse_chat_messages ----
def conversation(messages: list, fmt: str) -> list:
    out = []
    for m in messages:
        content = m.get("content")
        parts = [] if content is None else ([{"type": "text", "text": content}] if isinstance(content, str) else content)
        texts = []
        for p in parts:
            kind = p.get("type")
            if kind in ("text", "input_text", "output_text"):
                if p.get("text") is not None:
                    texts.append(p["text"])
            elif kind == "refusal":
                if p.get("refusal") is not None:
                    texts.append(p["refusal"])
            else:
                raise ValueError(f"unsupported part {kind}")
        msg = {"role": m["role"], "content": "\n".join(texts) if fmt == "string" else [{"type": "text", "text": t} for t in texts]}
        if m["role"] == "assistant":
            if m.get("tool_calls") is not None:
                msg["tool_calls"] = [json.loads(json.dumps(c)) for c in m["tool_calls"]]
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif m["role"] == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    for msg in out:  # _postprocess_messages
        if msg["role"] == "assistant" and "tool_calls" in msg:
            if len(msg["tool_calls"]) == 0:
                msg.pop("tool_calls")
                continue
            for item in msg["tool_calls"]:
                args = item["function"].get("arguments")
                item["function"]["arguments"] = (json.loads(args) if not isinstance(args, (dict, list)) else args) if args else {}
    return out


def tools_dump(tools):
    """`[tool.model_dump() for tool in request.tools]` with vLLM's pydantic models."""
    if tools is None:
        return None
    return [{"type": "function", "function": {"name": t["function"]["name"],
             "description": t["function"].get("description"),
             "parameters": t["function"].get("parameters")}} for t in tools]


def responses_messages(body: dict) -> list:
    msgs = []
    if body.get("instructions") is not None:
        msgs.append({"role": "system", "content": body["instructions"]})
    if isinstance(body["input"], str):
        msgs.append({"role": "user", "content": body["input"]})
    else:
        msgs.extend({"role": it["role"], "content": it.get("content")} for it in body["input"])
    return msgs


class Model:
    def __init__(self, d: Path, template_override: str | None):
        self.dir = d
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.cfg = json.loads((d / "tokenizer_config.json").read_text())
        self.source = template_override or self.cfg["chat_template"]
        self.env = environment()
        self.template = self.env.from_string(self.source)
        self.fmt = content_format(self.env, self.source)

    def specials(self) -> dict:
        keys = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {k: self.cfg[k] for k in keys if isinstance(self.cfg.get(k), str)}

    def tokens(self, endpoint: str, body: dict) -> list[int]:
        if endpoint == "completions":
            p = body["prompt"]
            if isinstance(p, list):
                return p
            return self.tok.encode(p, add_special_tokens=True).ids
        if endpoint == "responses":
            messages, tools, agp = responses_messages(body), None, True
        else:
            messages, tools = body["messages"], tools_dump(body.get("tools"))
            agp = body.get("add_generation_prompt", True)
        text = self.template.render(
            **self.specials(), messages=conversation(messages, self.fmt), tools=tools,
            documents=None, add_generation_prompt=agp)
        return self.tok.encode(text, add_special_tokens=False).ids


def make_dir(root: Path, name: str, specials: list[str], template: str | None, bos: str | None, bos_processor: bool) -> Path:
    d = root / name
    d.mkdir()
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    if specials:
        tok.add_special_tokens(specials)
    if bos_processor:
        tok.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((TINY / "tokenizer_config.json").read_text())
    cfg["bos_token"] = bos
    if template is not None:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def main() -> int:
    binary = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "target/debug/switchyard")
    requests = json.loads((HERE / "requests.json").read_text())
    big = long_text()
    for r in requests:
        for m in r["body"].get("messages", []):
            if m.get("content") == "LONG_TEXT":
                m["content"] = big
    failures, checked = 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        qwen = (TEMPLATES / "qwen2.5.jinja").read_text()
        llama = (TEMPLATES / "llama3.1.jinja").read_text()
        models = [
            ("tiny", TINY, None),
            ("qwen2.5", make_dir(root, "qwen", ["<|im_start|>", "<|im_end|>"], qwen, None, False), None),
            ("llama3.1", make_dir(root, "llama", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                                   llama, "<|begin_of_text|>", True), None),
            ("parts (--chat-template)", TINY, TEMPLATES / "parts.jinja"),
        ]
        for label, d, override in models:
            model = Model(d, override.read_text() if override else None)
            for r in requests:
                try:
                    want = model.tokens(r["endpoint"], r["body"])
                except jinja2.exceptions.TemplateError as e:
                    want = f"template error: {e}"
                cmd = [binary, "tokenize", "--model-dir", str(d), "--endpoint", r["endpoint"]]
                if override:
                    cmd += ["--chat-template", str(override)]
                run = subprocess.run(cmd, input=json.dumps(r["body"]).encode(), capture_output=True, timeout=60)
                got = json.loads(run.stdout) if run.returncode == 0 else f"error: {run.stderr.decode().strip()}"
                checked += 1
                ok = got == want or (isinstance(want, str) and isinstance(got, str))
                if not ok:
                    failures += 1
                    print(f"MISMATCH [{label}] {r['name']} ({model.fmt} content)\n  python:    {want}\n  switchyard: {got}")
    print(f"tokenize cross-check: {checked - failures}/{checked} requests match")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
