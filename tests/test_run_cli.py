"""`make run`'s stop strings and JSON schemas, through the command line on the embedded model
(one session for the module, handed to the command line in place of the one it would build)."""
from __future__ import annotations

import io
import json

import pytest

from llama_runtime.cli import run
from llama_runtime.generation.session import build_session

JAPAN = "What is the capital of Japan?"
CITY_QUESTION = "Describe the capital of Japan as JSON."
CITY = {"type": "object", "additionalProperties": False, "required": ["name", "country"],
        "properties": {"name": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}}}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return build_session("embedded", "sim", max_context=512, cache_dir=tmp_path_factory.mktemp("kernels"),
                         buckets=(128,), log=lambda s: None)


@pytest.fixture
def cli(session, monkeypatch, capsys):
    """Runs the command line; (exit status, stdout, stderr)."""
    monkeypatch.setattr(run, "build_session", lambda *a, **k: session)

    def call(*argv):
        code = run.run_cli(["--model", "embedded", "--device", "sim", *argv])
        out, err = capsys.readouterr()
        return code, out, err
    return call


def _answer(out: str) -> tuple[str, str]:
    """A single prompt's answer (between the [kernels] line and the [stats] one) and its stats."""
    answer, _, stats = out.partition("\n[stats] ")
    return answer.partition("[kernels] ")[2].partition("\n")[2], stats


def test_a_stop_string_cuts_the_answer_and_is_named_as_the_reason(cli):
    code, out, _ = cli("--prompt", JAPAN, "-n", "16")
    full, stats = _answer(out)
    assert code == 0 and "Tokyo" in full and "stopped: end of answer" in stats
    code, out, _ = cli("--prompt", JAPAN, "-n", "16", "--stop", "never", "--stop", "Tokyo")
    cut, stats = _answer(out)
    assert code == 0 and cut == full[: full.index("Tokyo")]
    assert 'stopped: stop string "Tokyo"' in stats


def test_a_json_schema_constrains_the_answer_to_a_document_it_accepts(cli, tmp_path):
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(CITY))
    code, out, _ = cli("--prompt", CITY_QUESTION, "-n", "60", "--json-schema", str(schema))
    answer, stats = _answer(out)
    city = json.loads(answer)
    assert code == 0 and set(city) == {"name", "country"} and all(isinstance(v, str) for v in city.values())
    assert "stopped: end of answer" in stats


@pytest.mark.parametrize("schema, needle", [
    ('{"type": "nonsense"}', "nonsense"),
    ('{"type": "string", "pattern": "(("}', "unclosed group"),     # llguidance's message spans lines
    ('{"type": ', "not valid JSON"),
    ("no-such-schema.json", "neither a JSON object nor a readable file"),
])
def test_a_bad_schema_is_one_error_line_before_any_loading(monkeypatch, capsys, schema, needle):
    def never(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run, "build_session", never)
    code = run.run_cli(["--prompt", "hi", "--json-schema", schema])
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(("error: --json-schema", "error: '--json-schema'")), lines
    assert needle in lines[0]


def test_chat_turns_stop_and_follow_the_schema_too(cli, monkeypatch):
    """Each turn of `make chat` gets the stop strings, and a grammar of its own: `--json` (any
    object) makes the second answer a whole object again, not the rest of the first."""
    france = CITY_QUESTION.replace("Japan", "France")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{CITY_QUESTION}\n{france}\n/quit\n"))
    code, out, _ = cli("--interactive", "-n", "80", "--json")
    answers = [line.partition("assistant> ")[2] for line in out.splitlines() if "assistant> " in line]
    assert code == 0 and len(answers) == 2 and all(isinstance(json.loads(a), dict) for a in answers)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{JAPAN}\n/quit\n"))
    code, out, _ = cli("--interactive", "-n", "16", "--stop", "Tokyo")
    answer = next(line for line in out.splitlines() if "assistant> " in line).partition("assistant> ")[2]
    assert code == 0 and answer and "Tokyo" not in answer and 'stopped: stop string "Tokyo"' in out
