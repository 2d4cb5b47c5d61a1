"""Reading `cosyvoice3.yaml`, the official HyperPyYAML model description, without executing it.

Tags are kept as data: `!new:pkg.Class` / `!name:pkg.fn` mappings become dicts with a
`"__tag__"` key, `!ref <a> * <b>` is evaluated against the top-level keys (numbers and
+ - * / only), and `!apply:` nodes (the official seeding calls) are dropped.
"""

from __future__ import annotations

import ast
import operator
import re
from pathlib import Path

import yaml

from intone.errors import ModelLoadError

_REF = re.compile(r"<([A-Za-z0-9_.]+)>")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class _Ref(str):
    pass


class _Loader(yaml.SafeLoader):
    pass


def _tagged(loader: _Loader, suffix: str, node: yaml.Node):
    kind, _, target = suffix.partition(":")
    if kind == "ref":
        return _Ref(loader.construct_scalar(node))
    if isinstance(node, yaml.MappingNode):
        value = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        value = {"args": loader.construct_sequence(node, deep=True)}
    else:
        value = {"value": loader.construct_scalar(node)}
    return {"__tag__": f"{kind}:{target}", **value}


_Loader.add_multi_constructor("!", _tagged)


def _arith(expr: str) -> float:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(expr)

    return ev(ast.parse(expr, mode="eval").body)


def _resolve(value, top: dict):
    if isinstance(value, _Ref):
        names = _REF.findall(value)
        if _REF.fullmatch(value.strip()):
            return _resolve(top[names[0]], top)
        return _arith(_REF.sub(lambda m: repr(_resolve(top[m.group(1)], top)), value))
    if isinstance(value, dict):
        return {k: _resolve(v, top) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top) for v in value]
    return value


def read_model_yaml(path: str | Path) -> dict:
    """The yaml as plain nested dicts with references resolved."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except yaml.YAMLError as e:
        raise ModelLoadError(f"{path}: not valid YAML ({e})") from None
    raw = {k: v for k, v in raw.items() if not k.startswith("__")}
    try:
        return _resolve(raw, raw)
    except (KeyError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"{path}: cannot resolve reference {e!r}") from None


def section(cfg: dict, name: str, path: str | Path = "cosyvoice3.yaml") -> dict:
    node = cfg.get(name)
    if not isinstance(node, dict):
        raise ModelLoadError(f"{path}: missing section {name!r}")
    return node


def args_of(node: dict, *names: str) -> dict:
    """The constructor arguments of a tagged node that the given dataclass fields name."""
    return {n: node[n] for n in names if n in node}
