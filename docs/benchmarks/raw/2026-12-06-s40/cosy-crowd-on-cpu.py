import sys, yaml, json
from pathlib import Path
sys.path.insert(0, "/work/main")
from intone.engine.config import PROFILE_DIR
from tests.api.conftest import start_server, stop_server, crowd_then_alone, traced_ends
tmp = Path(sys.argv[1]); tmp.mkdir(parents=True, exist_ok=True)
autocast = sys.argv[2]
settings = yaml.safe_load((PROFILE_DIR / "cosyvoice3-full-response.yaml").read_text())
settings["tf32"] = False
settings["ar"]["dtype"] = settings["codec"]["dtype"] = "float32"
settings["ar"]["static_step"] = True
settings["codec"].update({"stream": "loop"})
fl = settings.setdefault("cosyvoice3", {}).setdefault("flow", {})
fl.update({"compile": False, "autocast": autocast, "attention": "sdpa" if len(sys.argv) < 4 else sys.argv[3]})
settings["cosyvoice3"]["hift"] = {}
(tmp / "p.yaml").write_text(yaml.safe_dump(settings))
server = start_server(tmp, Path("/tmp/repro/cache"), "--model", "tiny:cosyvoice3", "--profile", str(tmp / "p.yaml"),
                      "--max-reference-seconds", "30", "--trace-frames", str(tmp / "frames.jsonl"))
try:
    crowd_then_alone(server, 12)
    print("PASS")
finally:
    stop_server(server)
