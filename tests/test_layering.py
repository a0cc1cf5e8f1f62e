"""Dependencies between the project's packages run one way, and no module imports itself back.

Every import counts, at module level or inside a function: a function-level import is how a
cycle hides, not how it is broken.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Bottom to top: a module may import from its own layer or the ones below it, never above.
LAYERS = (
    ("llama_base",),
    ("kernel_builder",),
    ("multi_launch_builder",),
    ("cpu_kernels",),
    ("npu_runtime",),
    ("llama_runtime",),
    ("llama32_1b_weights", "llama32_1b_decode", "llama32_1b_prefill", "llama32_1b_inference"),
    ("verify",),
    ("bench",),
)
RANK = {top: i for i, names in enumerate(LAYERS) for top in names}
# Inside `llama_runtime`, its rooms, bottom to top, by the same rule.
ROOMS = ("text", "checkpoints", "engine", "generation", "serve", "cli")
ROOM_RANK = {room: i for i, room in enumerate(ROOMS)}
# Web and HTTP libraries only the server may import: the engine and generation below it raise
# the runtime's own errors, which the server turns into HTTP ones.
HTTP_LIBRARIES = ("starlette", "uvicorn", "http", "fastapi", "httpx")


def project_modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for top in RANK:
        single = REPO / f"{top}.py"
        paths = [single] if single.is_file() else sorted((REPO / top).rglob("*.py"))
        for p in paths:
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = p
    return mods


def _targets(node: ast.AST, module: str, is_package: bool, mods: dict[str, Path]) -> list[str]:
    """Project modules an import statement loads (the deepest module each name resolves to)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_package else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = []
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        deps = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(_targets(node, module, path.name == "__init__.py", mods))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_cycles_hidden_in_functions(tmp_path):
    """The checker itself: a function-level import that closes a loop is a cycle."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    mods = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    assert cycles(import_graph(mods)) == [["a", "b"]]


def test_no_import_cycles():
    graph = import_graph(project_modules())
    assert len(graph) > 50      # the walk found the project
    assert cycles(graph) == []


def test_dependencies_point_down_the_layers():
    graph = import_graph(project_modules())
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                    if RANK[d.split(".")[0]] > RANK[m.split(".")[0]])
    assert upward == []


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "llama_runtime" and len(parts) > 2 else None


def test_every_module_of_llama_runtime_lives_in_a_room():
    """No flat module is left beside the rooms: a newcomer finds each part where its name says."""
    mods = project_modules()
    strays = [m for m in mods if m.startswith("llama_runtime.") and room(m) not in ROOM_RANK
              and m.split(".")[1] not in ROOM_RANK]
    assert strays == []
    assert {m.split(".")[1] for m in mods if m.startswith("llama_runtime.")} == set(ROOMS)


def test_the_rooms_of_llama_runtime_import_only_downwards():
    graph = import_graph(project_modules())
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                    if room(m) and room(d) and ROOM_RANK[room(d)] > ROOM_RANK[room(m)])
    assert upward == []


def test_the_room_checker_catches_an_upward_import(tmp_path):
    """The check itself: an engine module that imports the server is reported."""
    graph = {"llama_runtime.engine.decode": {"llama_runtime.serve.app"}, "llama_runtime.serve.app": set()}
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
              if room(m) and room(d) and ROOM_RANK[room(d)] > ROOM_RANK[room(m)]]
    assert upward == ["llama_runtime.engine.decode -> llama_runtime.serve.app"]


def test_only_the_server_speaks_http():
    """Below `serve/` nothing imports a web library, so no engine or generation code can raise an
    HTTP error; the server maps the runtime's errors to statuses."""
    offenders = []
    for module, path in project_modules().items():
        if room(module) not in ("text", "checkpoints", "engine", "generation"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{module} -> {n}" for n in names if n.split(".")[0] in HTTP_LIBRARIES]
    assert offenders == []


def test_devices_stay_apart_and_the_cache_drives_any_of_them():
    """The simulated and XRT devices never import each other, and the KernelCache knows only the
    device API: a third device plugs in without touching either."""
    graph = import_graph(project_modules())
    for a, b in (("npu_runtime.sim", "npu_runtime.xrt"), ("npu_runtime.xrt", "npu_runtime.sim")):
        assert not [f"{m} -> {d}" for m, deps in graph.items() if m.startswith(a)
                    for d in deps if d.startswith(b)]
    for cache in ("npu_runtime.cache", "npu_runtime.artifacts"):
        assert not [d for d in graph[cache] if d.startswith(("npu_runtime.sim", "npu_runtime.xrt"))]


def test_the_apps_import_the_session_they_drive():
    """The command line, chat and server sit above `llama_runtime.generation.session` and import it: the
    dependency is declared where the layers can check it, not handed down as a callback."""
    graph = import_graph(project_modules())
    apps = ("llama_runtime.cli.run", "llama_runtime.generation.chat", "llama_runtime.serve.app", "llama_runtime.serve.worker")
    for app in apps:
        assert "llama_runtime.generation.session" in graph[app], app
    assert not graph["llama_runtime.generation.session"] & set(apps)


def test_the_host_ops_run_on_the_cpu_kernels_not_on_the_simulator():
    """The host ops run on every device, the NPU included: they reach the native library through
    `cpu_kernels`, never through the simulated device."""
    graph = import_graph(project_modules())
    assert not [f"{m} -> {d}" for m, deps in graph.items() if m.startswith("llama_runtime")
                for d in deps if d.startswith("npu_runtime.sim")]
    assert "cpu_kernels.native_cpu" in graph["llama_runtime.engine.kv_cache"]
    # the CPU kernels know tensors and the Q4NX format, not group declarations
    assert {d.split(".")[0] for m, deps in graph.items() if m.startswith("cpu_kernels") for d in deps} <= {
        "cpu_kernels", "llama_base"}
