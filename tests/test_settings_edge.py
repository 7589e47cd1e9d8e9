"""How far the run's whole config reaches into the library, measured with `ast` (issue 45's measures).

M1: functions that take the RunConfig or read `config.<section>`; M2: those of them that read two or
more sections; M3: reads of `run.config`; M4: call sites of the helpers that derive a setting from the
whole config. Each is counted outside the edge, which holds the config: config.py, settings.py (which
resolves it, once, into each stage's settings), cli.py (the commands' convention, which reads it) and
the commands. The goal, held here, is 0 for each.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "occamy_mtp"
SECTIONS = {"model", "data", "train", "eval", "output"}
DERIVED = {"require_set", "window_settings", "selected_serving", "fingerprinted", "step_loss_weights", "train_text",
           "serving_text", "self_generated_dir"}
CEILINGS = {"M1": 0, "M2": 0, "M3": 0, "M4": 0}
EDGE = ("occamy_mtp/config.py", "occamy_mtp/settings.py", "occamy_mtp/cli.py")


def measures(package: Path = PACKAGE) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {name: [] for name in CEILINGS}
    for path in sorted(package.rglob("*.py")):
        where = str(path.relative_to(package.parent))
        if where in EDGE or where.startswith("occamy_mtp/commands/"):  # the edge, which holds the config
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.args + node.args.kwonlyargs
                takes = any(a.annotation is not None and "RunConfig" in ast.unparse(a.annotation) for a in arguments)
                sections = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr in SECTIONS
                            and ast.unparse(n.value).endswith("config")}
                if takes or sections:
                    found["M1"].append(f"{where}:{node.name}")
                if len(sections) >= 2:
                    found["M2"].append(f"{where}:{node.name}")
            elif isinstance(node, ast.Attribute) and node.attr == "config" and ast.unparse(node.value).endswith("run"):
                found["M3"].append(f"{where}:{node.lineno}")
            elif isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name in DERIVED:
                    found["M4"].append(f"{where}:{node.lineno}:{name}")
    return found


def test_the_whole_config_stops_at_the_edge():
    found = measures()
    over = {name: len(found[name]) for name in CEILINGS if len(found[name]) > CEILINGS[name]}
    assert not over, f"the run's config reaches past the edge: {over}, at {[found[name] for name in over]}; " \
                     "hand the stage its own settings (occamy_mtp/settings.py) instead"


def test_the_measures_count_what_they_say(tmp_path):
    package = tmp_path / "occamy_mtp"
    package.mkdir()
    (package / "config.py").write_text("def window_settings(data):\n    return data.context_tokens\n")
    (package / "stage.py").write_text(
        "from occamy_mtp.config import RunConfig, window_settings\n"
        "def plain(tokens: int):\n    return tokens\n"
        "def whole(config: RunConfig):\n    return config.data.files, config.train.lr\n"
        "def one(run):\n    return run.config.data, window_settings(run.config.data)\n")
    found = measures(package)
    assert found["M1"] == ["occamy_mtp/stage.py:whole", "occamy_mtp/stage.py:one"]
    assert found["M2"] == ["occamy_mtp/stage.py:whole"]
    assert len(found["M3"]) == 2 and found["M4"] == ["occamy_mtp/stage.py:7:window_settings"]
