"""Constructs of the published chat templates, with templates written here that use them.

Tool calls written argument by argument, as Qwen3.5's template (`<parameter=NAME>` blocks, Jinja's `items` filter)
and GLM-4.7's (`arguments.items()`) write them, with `loop.previtem` / `loop.nextitem` and
`tojson(ensure_ascii=False)`: the build's ids equal apply_chat_template's with the same template and tokenizer, and
arguments given as a JSON string, which such a template cannot iterate (nor can transformers), are a one-line error
naming the message, not a traceback. The named special tokens (`{{ bos_token }}` of Llama-style templates) are those
the tokenizer sets, as transformers gives them: a tokenizer without a BOS token (Qwen's) writes nothing there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from openrecipes.data.bundled import TOKENIZER
from openrecipes.data.templates import LOSS_MASKS, ChatRenderer

from tests.data.sft_data_helpers import run_build, tokenize_conversations, write_jsonl

PARAMETERS = r"""
{%- for message in messages -%}
{%- if message.role == "assistant" -%}
<|im_start|>assistant{{ "\n" + message.content }}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{{ ("\n" if message.content or not loop.first else "") + "<tool_call>\n<function=" + call.name + ">\n" }}
{%- for key, value in ARGUMENTS -%}
{%- set value = value | tojson(ensure_ascii=False) if value is mapping or (value is sequence and value is not string)
    else value | string -%}
{{ "<parameter=" + key + ">\n" + value + "\n</parameter>\n" }}
{%- endfor -%}
</function>{{ "\n" }}</tool_call>
{%- endfor -%}
<|im_end|>{{ "\n" }}
{%- elif message.role == "tool" -%}
{%- if loop.previtem and loop.previtem.role != "tool" %}<|im_start|>user{% endif -%}
{{ "\n<tool_response>\n" + message.content + "\n</tool_response>" }}
{%- if loop.last or loop.nextitem.role != "tool" %}<|im_end|>{{ "\n" }}{% endif -%}
{%- else -%}
<|im_start|>{{ message.role + "\n" + message.content }}<|im_end|>{{ "\n" }}
{%- endif -%}
{%- endfor -%}
"""
# Qwen3.5's spelling, and GLM-4.7's
FILTER, METHOD = "call.arguments | items", "call.arguments.items()"


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def weather(arguments: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Weather in Zürich and Oslo?"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             call("weather", arguments), call("weather", {"city": "Oslo", "days": [1, 2]})]},
                         {"role": "tool", "content": "☀️ 25°"}, {"role": "tool", "content": "rain"},
                         {"role": "assistant", "content": "Sunny in Zürich, rain in Oslo."}]}


def template(tmp_path: Path, arguments: str) -> Path:
    path = tmp_path / f"{len(arguments)}.jinja"
    path.write_text(PARAMETERS.replace("ARGUMENTS", arguments), encoding="utf-8")
    return path


@pytest.mark.parametrize("arguments", [FILTER, METHOD])
def test_argument_blocks_equal_apply_chat_template(tmp_path, arguments):
    transformers = pytest.importorskip("transformers")
    path = template(tmp_path, arguments)
    record = weather({"city": "Zürich", "when": {"day": "today"}, "hourly": False})
    ((ids, mask),), bundle = tokenize_conversations([record], tmp_path / "build", chat_template=str(path))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER / "tokenizer.json"))
    hf.chat_template = path.read_text(encoding="utf-8")
    assert ids == list(hf.apply_chat_template(record["messages"], tokenize=True)["input_ids"])
    supervised = bundle.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert supervised == ('<tool_call>\n<function=weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=when>\n'
                          '{"day": "today"}\n</parameter>\n<parameter=hourly>\nFalse\n</parameter>\n</function>\n'
                          '</tool_call>\n<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n'
                          '<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call><|im_end|>'
                          'Sunny in Zürich, rain in Oslo.<|im_end|>')


@pytest.mark.parametrize("arguments", [FILTER, METHOD])
def test_arguments_as_a_json_string_are_a_one_line_error_naming_the_message(tmp_path, arguments):
    record = weather(json.dumps({"city": "Zürich"}))
    with pytest.raises(ValueError, match=r"^conversation 0: chat template: \w+Error: .*\(message 2 gives a tool "
                                         r"call's arguments as a JSON string") as caught:
        tokenize_conversations([record], tmp_path / "build", chat_template=str(template(tmp_path, arguments)))
    assert "\n" not in str(caught.value)
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER / "tokenizer.json"))
    hf.chat_template = template(tmp_path, arguments).read_text(encoding="utf-8")
    with pytest.raises(Exception):  # transformers cannot render it either
        hf.apply_chat_template(record["messages"], tokenize=True)


def test_skip_invalid_counts_them_as_template_errors(tmp_path):
    records = [weather({"city": "Zürich"}), weather(json.dumps({"city": "Zürich"}))]
    manifest = run_build(tmp_path / "out", input=write_jsonl(tmp_path / "in.jsonl", records), row_tokens=32,
                         chat_template=template(tmp_path, FILTER), skip_invalid=True)
    assert manifest["counts"]["conversations_invalid"] == 1
    assert manifest["invalid_reasons"]["template error"]["first"] == [f"{tmp_path / 'in.jsonl'} line 2"]


def test_python_errors_inside_a_template_are_template_errors():
    """A string plus a list, a division by zero: what the template does with the data, not a crash."""
    for source, name in (("{{ messages[0].content + [] }}", "TypeError"),
                         ("{{ (messages | length) // 0 }}", "ZeroDivisionError")):
        renderer = ChatRenderer(template=source, loss_mask=LOSS_MASKS["qwen3"], special_tokens={}, template_kwargs={})
        with pytest.raises(ValueError, match=f"^chat template: {name}"):
            renderer.render([{"role": "user", "content": "q"}])


def test_named_special_tokens_are_those_the_tokenizer_sets(tmp_path):
    """The bundled tokenizer sets eos_token and pad_token, not bos_token nor unk_token."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER, directory)
    (directory / "chat_template.jinja").write_text(
        "{{ bos_token }}{{ unk_token is defined }}{{ pad_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endfor %}", encoding="utf-8")
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    ((ids, _),), bundle = tokenize_conversations([record], tmp_path / "build", tokenizer=directory)
    assert bundle.tokenizer.decode(ids, skip_special_tokens=False).startswith("False<|endoftext|><|im_start|>user")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))
    assert ids == list(hf.apply_chat_template(record["messages"], tokenize=True)["input_ids"])


# a developer message naming the built-in tools a list variable enables, as gpt-oss's template does with builtin_tools
TOOLS_LIST = r"""
{%- if builtin_tools is defined and builtin_tools -%}
<|im_start|>system{{ "\n# Tools: " + builtin_tools | join(", ") }}<|im_end|>{{ "\n" }}
{%- endif -%}
{%- for message in messages -%}
<|im_start|>{{ message.role + "\n" + message.content }}<|im_end|>{{ "\n" }}
{%- endfor -%}
"""


def test_a_list_template_variable_reaches_the_template_as_apply_chat_template_passes_it(tmp_path):
    from openrecipes.data.templates import parse_template_kwargs

    transformers = pytest.importorskip("transformers")
    path = tmp_path / "tools.jinja"
    path.write_text(TOOLS_LIST, encoding="utf-8")
    kwargs = parse_template_kwargs(['builtin_tools=["browser", "python"]', "reasoning_effort=high"])
    assert kwargs == {"builtin_tools": ["browser", "python"], "reasoning_effort": "high"}
    conversation = {"messages": [{"role": "user", "content": "Look it up."},
                                 {"role": "assistant", "content": "Found it."}]}
    [(ids, _)], _ = tokenize_conversations([conversation], tmp_path, chat_template=str(path), template_kwargs=kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER))
    expected = tokenizer.apply_chat_template(conversation["messages"], chat_template=TOOLS_LIST, tokenize=True,
                                             return_dict=False, **kwargs)
    assert list(ids) == list(expected) and "# Tools: browser, python" in tokenizer.decode(ids)


@pytest.mark.parametrize("value", ['[1, 2]', '["browser"', '[{"name": "browser"}]'])
def test_a_list_template_variable_must_be_a_json_list_of_strings(value):
    from openrecipes.config.recipe import DataBuild
    from openrecipes.data.templates import parse_template_kwargs

    with pytest.raises(ValueError, match="builtin_tools: a value starting with '\\[' must be a JSON list of strings"):
        parse_template_kwargs([f"builtin_tools={value}"])
    with pytest.raises(ValueError, match="template_kwargs"):
        DataBuild(row_tokens=64, template_kwargs={"builtin_tools": [1, 2]})
