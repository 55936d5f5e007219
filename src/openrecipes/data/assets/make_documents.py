"""Make the bundled text documents (pretraining input) from the bundled conversations.

Each conversation becomes one document: the content of its messages, in order, joined by blank lines (reasoning,
tool calls and tool definitions left out). The text is the project's own synthetic text, so the documents carry
its license. Run from the repository root:

    PYTHONPATH=src python src/openrecipes/data/assets/make_documents.py

Writes ``documents.jsonl`` beside this file: one ``{"text": ...}`` object per line, in the conversations' order.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent


def document_text(record: dict) -> str:
    return "\n\n".join(m["content"] for m in record["messages"] if isinstance(m.get("content"), str) and m["content"])


def main() -> None:
    lines = (HERE / "conversations.jsonl").read_text(encoding="utf-8").splitlines()
    documents = [json.dumps({"text": document_text(json.loads(line))}, ensure_ascii=False) for line in lines if line]
    (HERE / "documents.jsonl").write_text("\n".join(documents) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
