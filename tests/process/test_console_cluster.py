"""The console's cluster map (api/server/ui/assets/cluster.js) on a stand-in DOM,
under node: each node's card names its GPU type, the emulated speed of a slowed
fake node, which values an operator set, and what the registry ignored."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.process.test_console_chart import ASSETS, FAKE_DOM

NODES = [
    {"name": "h100-0", "gpus": 1, "nvlink": [[0]], "leaf": "l", "alive": True, "free_gpus": 1,
     "accelerator": "H100", "gpu_type": "h100-80gb", "emulated_speed": None, "problems": [],
     "gpu_map": [], "overrides": None},
    {"name": "slow-0", "gpus": 1, "nvlink": [[0]], "leaf": "l", "alive": True, "free_gpus": 1,
     "accelerator": None, "gpu_type": "a100-80gb", "emulated_speed": 0.5,
     "problems": ["label kc.io/gpu-type ignored: 'b200' is not a GPU type"], "gpu_map": [],
     "overrides": {"emulated_speed": 0.5}},
    {"name": "old-0", "gpus": 1, "nvlink": [[0]], "leaf": "l", "alive": True, "free_gpus": 1,
     "gpu_map": []},  # an older registry's entry: no type at all
]

SCRIPT = r"""
import "./fake_dom.js";
globalThis.window = {sessionStorage: {getItem: () => null}};
const {nodeCard} = await import("./cluster.js");
const nodes = JSON.parse(process.argv[2]);
const out = nodes.map((n) => {
  const card = nodeCard(n, new Map());
  const type = card.all((e) => e.attrs.class === "gpu-type")[0];
  return {type: type.textContent, data: type.attrs["data-gpu-type"],
          speed: type.attrs["data-emulated-speed"],
          problems: card.all((e) => e.attrs.class === "flag problem").map((e) => e.textContent)};
});
console.log(JSON.stringify(out));
"""


@pytest.fixture(scope="module")
def cards(tmp_path_factory) -> list[dict]:
    node = shutil.which("node")
    assert node is not None, "the console's cluster-map test runs cluster.js under Node.js: install nodejs"
    work = tmp_path_factory.mktemp("cluster")
    for name in ("cluster.js", "dom.js", "api.js", "goodput.js"):
        shutil.copy(ASSETS / name, work / name)
    (work / "package.json").write_text('{"type": "module"}')
    (work / "fake_dom.js").write_text(FAKE_DOM)
    (work / "run.js").write_text(SCRIPT)
    out = subprocess.run([node, "run.js", json.dumps(NODES)], cwd=work, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_each_card_names_the_gpu_type(cards):
    real, _, old = cards
    assert real["type"] == "type h100-80gb · Ray sees H100" and real["data"] == "h100-80gb"
    assert old["type"] == "type unknown" and old["data"] == "" and old["speed"] == ""


def test_a_slowed_fake_node_says_emulated_and_what_the_operator_set(cards):
    slow = cards[1]
    assert slow["type"] == ("type a100-80gb · emulated at 0.5x · set by an operator: "
                            "emulated speed")
    assert slow["speed"] == "0.5"
    assert slow["problems"] == ["label kc.io/gpu-type ignored: 'b200' is not a GPU type"]
    assert cards[0]["problems"] == []
