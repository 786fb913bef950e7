"""Agent tools: the @tool schema and validation, calculator, search, http, the python sandbox, MCP.

Run: python -m pytest -q tests/test_agent_tools.py  (~20 s; the MCP server start imports pellucid)
"""

from __future__ import annotations

import _ctypes
import dis
import json
import re
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal

import httpx
import pytest

from pellucid.agent.tools import (
    MCPConnection,
    ToolError,
    builtin_tools,
    calculator,
    make_http_tool,
    make_python_tool,
    make_search_tool,
    python_sandbox,
    tool,
)
from pellucid.agent.tools.python_sandbox import landlock_abi, run_sandboxed


@tool
def forecast(
    city: str,
    days: int,
    units: Literal["metric", "imperial"] = "metric",
    hours: list[int] | None = None,
    detailed: bool = False,
) -> dict:
    """Get the weather forecast for a city.

    Uses the national weather services.

    Args:
        city: The city's name, e.g. "Oslo".
        days (int): How many days ahead,
            from 1 to 7.
        units: The unit system.

    Returns:
        The forecast.
    """
    if days > 7:
        raise ValueError("at most 7 days")
    return {"city": city, "days": days, "units": units, "hours": hours}


# --- Tool and @tool ---


def test_tool_schema_from_a_typed_documented_function() -> None:
    assert forecast.openai_schema() == {
        "type": "function",
        "function": {
            "name": "forecast",
            "description": "Get the weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": 'The city\'s name, e.g. "Oslo".'},
                    "days": {"type": "integer", "description": "How many days ahead, from 1 to 7."},
                    "units": {
                        "type": "string",
                        "enum": ["metric", "imperial"],
                        "description": "The unit system.",
                    },
                    "hours": {"type": "array", "items": {"type": "integer"}},
                    "detailed": {"type": "boolean"},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    }


def test_tool_call_takes_a_dict_or_json_and_returns_text() -> None:
    expected = {"city": "Oslo", "days": 2, "units": "metric", "hours": None}
    assert json.loads(forecast({"city": "Oslo", "days": 2})) == expected
    assert json.loads(forecast('{"city": "Oslo", "days": 2}')) == expected


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"days": 2}, "forecast: argument 'city' is required"),
        ({"city": "Oslo", "days": "two"}, "forecast: argument 'days': 'two' is not of type"),
        ({"city": "Oslo", "days": 2, "units": "kelvin"}, "argument 'units': 'kelvin' is not one"),
        ({"city": "Oslo", "days": 2, "hours": [1, "x"]}, "argument 'hours'[1]: 'x' is not of"),
        ({"city": "Oslo", "days": 2, "wind": True}, "forecast: unexpected argument 'wind'"),
        ('{"city": "Oslo", ', "forecast: arguments are not valid JSON"),
        ("[1, 2]", "forecast: arguments must be a JSON object"),
        ({"city": "Oslo", "days": 9}, "forecast failed: at most 7 days"),
    ],
)
def test_tool_call_errors_are_written_for_the_model(arguments: dict | str, message: str) -> None:
    with pytest.raises(ToolError) as error:
        forecast(arguments)
    assert message in str(error.value)


def test_tool_refuses_untyped_parameters_at_decoration_time() -> None:
    def untyped(x, y: int) -> int:  # x has no hint: the point of the test
        return y

    with pytest.raises(TypeError, match="parameter 'x' needs a type hint"):
        tool(untyped)


def test_builtin_tools_by_name() -> None:
    tools = builtin_tools(["calculator", "http", "python"])
    assert [t.name for t in tools] == ["calculator", "http", "python"]
    with pytest.raises(ValueError, match=r"'shell'.*\['calculator', 'search', 'http', 'python'\]"):
        builtin_tools(["calculator", "shell"])


# --- calculator ---


@pytest.mark.parametrize(
    ("expression", "result"),
    [
        ("17*23", "391"),
        ("2 + 3 * 4 ** 2", "50"),
        ("(2 + 3) * 4", "20"),
        ("-2 ** 2", "-4"),
        ("7 // 2 + 7 % 2", "4"),
        ("10 / 4", "2.5"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("round(pi, 3) * floor(e)", "6.284"),
        ("log10(1000) + abs(-1)", "4.0"),
    ],
)
def test_calculator_arithmetic(expression: str, result: str) -> None:
    assert calculator({"expression": expression}) == f"{expression} = {result}"


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os')", "function '__import__' is not allowed"),
        ("__import__('os').system('echo hi')", "attribute access ('.system') is not allowed"),
        ("(lambda: 1)()", "Lambda expressions are not allowed"),
        ("(1).__class__", "attribute access ('.__class__') is not allowed"),
        ("math.pi", "attribute access ('.pi') is not allowed"),
        ("x + 1", "unknown name 'x'"),
        ("9 ** 9 ** 9", "exponent 387420489 is larger than 1000"),
        ("(10 ** 1000) ** 1000", "result too large"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("sqrt(-1)", "sqrt is undefined for -1"),
        ("exp(1000)", "result too large"),
        ("[1, 2]", "List expressions are not allowed"),
        ("1 < 2", "Compare expressions are not allowed"),
        ("2 +", "cannot parse"),
        ("-" * 1500 + "1", "nested too deeply"),
    ],
)
def test_calculator_refuses_with_a_clear_error(expression: str, message: str) -> None:
    with pytest.raises(ToolError, match=f"^calculator: .*{re.escape(message)}"):
        calculator({"expression": expression})


def test_calculator_counts_nesting_itself_whatever_the_recursion_limit() -> None:
    """torch's compiler raises Python's recursion limit (to 2,000 when it compiles), so that a
    RecursionError alone would let a server that had compiled walk 1,500 nested signs (a `make
    test` run did). 200 levels are taken, 201 are refused, at any limit."""
    assert calculator({"expression": "1" + "+1" * 200}) == "1" + "+1" * 200 + " = 201"
    limit = sys.getrecursionlimit()
    try:
        for raised in (limit, 20_000):
            sys.setrecursionlimit(raised)
            for deep in (
                "-" * 201 + "1",
                "1" + "+1" * 201,
                "abs(" * 100 + "-" * 101 + "1" + ")" * 100,
            ):
                with pytest.raises(ToolError, match="nested too deeply"):
                    calculator({"expression": deep})
    finally:
        sys.setrecursionlimit(limit)


# --- search ---


def test_search_wikipedia_finds_who_wrote_hamlet() -> None:
    text = make_search_tool()({"query": "Who wrote Hamlet?"})
    hits = text.splitlines()
    assert len(hits) == 3
    assert any(hit.startswith(f"[{n}] Hamlet: ") for n, hit in enumerate(hits[:3], 1))
    assert "William Shakespeare" in text


def test_search_can_show_only_the_first_sentences() -> None:
    one = make_search_tool(k=1, sentences=1)({"query": "Hamlet"})
    two = make_search_tool(k=1, sentences=2)({"query": "Hamlet"})
    assert one.startswith("[1] Hamlet: ") and one.endswith("1601.")  # "... Shakespeare ... 1601."
    assert two.startswith(one + " It is ") and two.endswith(".")  # "It is Shakespeare's ..."
    with pytest.raises(ValueError, match="sentences"):
        make_search_tool(sentences=0)


def test_search_folder_picks_the_right_file(tmp_path: Path) -> None:
    (tmp_path / "cats.txt").write_text("Cats are small felines that purr and hunt mice.")
    (tmp_path / "rockets.md").write_text("# Rockets\n\nA rocket reaches orbit by burning fuel.")
    (tmp_path / "bread.txt").write_text("Bread is baked from flour, water and yeast.")
    hits = make_search_tool(tmp_path, k=2)({"query": "how do rockets get to orbit"}).splitlines()
    assert hits[0].startswith("[1] rockets.md: # Rockets A rocket reaches orbit")
    assert len(hits) == 1  # the other files share no word with the query


def test_search_folder_must_exist_and_hold_documents(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        make_search_tool(tmp_path / "missing")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="no .txt or .md files"):
        make_search_tool(tmp_path)


# --- http ---


class _JSONHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://example.com/")
            self.end_headers()
        elif self.path == "/big":
            self._reply({"data": "x" * 100_000})
        else:
            self._reply({"path": self.path})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._reply({"got": body})

    def _reply(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def local_api() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _JSONHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_http_calls_a_local_json_api(local_api: str) -> None:
    http = make_http_tool()
    assert http({"url": f"{local_api}/v1/models"}) == 'HTTP 200 OK\n{"path": "/v1/models"}'
    posted = http({"url": f"{local_api}/echo", "method": "POST", "body": {"a": [1, 2]}})
    assert posted == 'HTTP 200 OK\n{"got": {"a": [1, 2]}}'
    redirect = http({"url": f"{local_api}/redirect"})
    assert redirect.startswith("HTTP 302: redirect to http://example.com/ (not followed")
    big = http({"url": f"{local_api}/big"})
    assert len(big) < 4100 and big.endswith("[... cut at 4000 characters]")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://example.com/", "host 'example.com' is not on the allow-list"),
        ("http://127.0.0.1@example.com/", "host 'example.com' is not on the allow-list"),
        ("https://10.0.0.1:8080/admin", "host '10.0.0.1' is not on the allow-list"),
        ("file:///etc/passwd", "only http:// and https:// URLs are allowed"),
    ],
)
def test_http_refuses_before_connecting(
    url: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the http tool opened a connection")

    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", no_network)
    with pytest.raises(ToolError, match=message):
        make_http_tool()({"url": url})


# --- python sandbox ---


@pytest.fixture(params=["all layers", "audit hook alone"])
def sandbox(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """Each escape test runs twice: the audit hook must hold without the kernel's help."""
    kernel = request.param == "all layers"
    return lambda code: run_sandboxed(code, timeout_s=10, kernel_layers=kernel)


def test_python_prints_a_computed_result() -> None:
    assert make_python_tool()({"code": "print(sum(i * i for i in range(10)))"}) == "285"


def test_python_writes_only_in_its_own_temp_dir_which_is_then_deleted() -> None:
    code = (
        "import os, pathlib\n"
        "pathlib.Path('out').mkdir()\n"
        "open('out/a.txt', 'w').write('hello')\n"
        "print(open('out/a.txt').read(), os.listdir('out'), os.getcwd())\n"
    )
    text, listing, cwd = run_sandboxed(code).split(" ", 2)
    assert (text, listing) == ("hello", "['a.txt']")
    assert cwd.startswith(str(Path(tempfile.gettempdir()).resolve()))
    assert not Path(cwd).exists()


def test_python_cannot_read_outside_its_temp_dir(
    sandbox: Callable[[str], str], tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the launch codes")
    for path in ("/etc/passwd", str(secret)):
        out = sandbox(f"print(open({path!r}).read())")
        assert "PermissionError" in out
        assert "root:" not in out and "launch codes" not in out


def test_python_cannot_list_the_root(sandbox: Callable[[str], str]) -> None:
    out = sandbox("import os\nprint(os.listdir('/'))")
    assert "PermissionError" in out and "'etc'" not in out


def test_python_cannot_open_a_socket(sandbox: Callable[[str], str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        out = sandbox(f"import socket\nsocket.socket().connect(('127.0.0.1', {port}))")
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert "PermissionError" in out


@pytest.mark.parametrize(
    "code",
    [
        "import subprocess\nsubprocess.run(['echo', str(6 * 7)])",
        "import os\nos.system('echo ' + str(6 * 7))",
        "import os\nos.execv('/bin/echo', ['echo', str(6 * 7)])",
    ],
)
def test_python_cannot_spawn_a_process(sandbox: Callable[[str], str], code: str) -> None:
    out = sandbox(code)
    assert "PermissionError" in out and "42" not in out.splitlines()


def test_python_hook_cannot_be_switched_off(sandbox: Callable[[str], str]) -> None:
    # A traceback reaches the hook's frame, and through it the hook's path helper.
    code = (
        "try:\n"
        "    open('/etc/passwd')\n"
        "except PermissionError as e:\n"
        "    tb = e.__traceback__\n"
        "    while tb.tb_next:\n"
        "        tb = tb.tb_next\n"
        "    helper = tb.tb_frame.f_locals['realpath']\n"
        "    helper.__code__ = (lambda path, cwd, lstat, readlink, oserror: cwd).__code__\n"
        "print(open('/etc/passwd').read())\n"
    )
    out = sandbox(code)
    assert "changing the sandbox's own functions is not allowed" in out and "root:" not in out


@pytest.mark.parametrize(
    ("code", "module"),
    [
        ("import ctypes", "ctypes"),
        # Under another name: an extension's init symbol still comes from the last part.
        (
            (
                "import importlib.util as u\n"
                f"u.module_from_spec(u.spec_from_file_location('x._ctypes', {_ctypes.__file__!r}))"
            ),
            "_ctypes",
        ),
    ],
)
def test_python_cannot_load_ctypes(sandbox: Callable[[str], str], code: str, module: str) -> None:
    assert f"ImportError: sandbox: the module {module!r} is not available" in sandbox(code)


def test_python_hook_reads_no_globals() -> None:
    """The sandboxed code can rebind builtins and module globals; the hook must not see them."""
    code = compile(python_sandbox._CHILD, "<child>", "exec")
    checked = 0
    for const in [c for c in code.co_consts if hasattr(c, "co_code")]:
        inner = [const, *[c for c in const.co_consts if hasattr(c, "co_code")]]
        for fn in inner:
            if fn.co_name in ("hook", "_realpath"):
                checked += 1
                loads = [i.argval for i in dis.get_instructions(fn) if i.opname == "LOAD_GLOBAL"]
                assert loads == [], f"{fn.co_name} reads globals {loads}"
    assert checked == 2


@pytest.mark.skipif(landlock_abi() == 0, reason="needs Landlock (Linux 5.13+)")
def test_python_kernel_confines_files_without_the_hook(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the launch codes")
    out = run_sandboxed(f"print(open({str(secret)!r}).read())", audit_hook=False)
    assert "PermissionError: [Errno 13]" in out and "launch codes" not in out


@pytest.mark.skipif(
    not python_sandbox._namespaces() and landlock_abi() < 4,
    reason="needs unprivileged network namespaces or Landlock ABI 4+ (Linux 6.7)",
)
def test_python_kernel_cuts_the_network_without_the_hook() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}))"
        out = run_sandboxed(code, audit_hook=False)
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert "Traceback" in out


def test_python_timeout_kills_the_program() -> None:
    with pytest.raises(ToolError, match=r"python: killed after 2 s .*Output so far:\nstarted"):
        make_python_tool(timeout_s=2)({"code": "print('started')\nwhile True:\n    pass"})


# --- MCP ---


def test_mcp_example_server_tools_over_stdio() -> None:
    command = [sys.executable, "-m", "pellucid.agent.tools.mcp_example_server"]
    with MCPConnection(command) as connection:
        tools = {t.name: t for t in connection.tools}
        assert {"word_count", "reverse", "divide"} <= set(tools)
        assert tools["reverse"].openai_schema()["function"]["parameters"]["required"] == ["text"]
        assert tools["word_count"]({"text": "to be or not to be"}) == "6"
        assert tools["reverse"]('{"text": "stressed"}') == "desserts"
        with pytest.raises(ToolError, match="divide: .*cannot divide by zero"):
            tools["divide"]({"a": 1, "b": 0})
    with pytest.raises(ToolError, match="is not running"):
        tools["reverse"]({"text": "closed"})


def test_mcp_server_that_fails_to_start_names_its_command() -> None:
    with pytest.raises(RuntimeError, match=r"MCP server .*no_such_server_module failed to start"):
        MCPConnection([sys.executable, "-m", "no_such_server_module"])
