"""Reading weights out of an ONNX graph, for the torch ports of CosyVoice3's frontend models.

An `OnnxGraph` indexes the nodes of a loaded file and resolves a node input to its constant
value (a graph initializer or the output of a `Constant` node). Lookups that the architecture
needs and the file lacks raise `ModelLoadError` naming the file and the tensor; a graph that is
not the expected architecture at all raises `NotThisArchitecture` (the frontend then runs the
file through onnxruntime instead).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from intone.errors import ModelLoadError


class NotThisArchitecture(Exception):
    """The graph is not the network a torch port implements (not an error: use onnxruntime)."""


class OnnxGraph:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            import onnx
            from onnx import numpy_helper
        except ImportError as e:
            raise ModelLoadError(f"{self.path}: reading ONNX weights needs the onnx package ({e})") from None
        try:
            model = onnx.load(str(self.path))
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise ModelLoadError(f"{self.path}: not a readable ONNX file ({type(e).__name__}: {e})") from None
        self._to_array = numpy_helper.to_array
        self._attr = onnx.helper.get_attribute_value
        graph = model.graph
        self.nodes = list(graph.node)
        self._init = {t.name: t for t in graph.initializer}
        # old exporters also list the initializers as graph inputs
        self.input_names = [i.name for i in graph.input if i.name not in self._init]
        self.output_names = [o.name for o in graph.output]
        self._constants = {n.output[0]: n for n in self.nodes if n.op_type == "Constant"}
        self._by_name = {n.name: n for n in self.nodes}
        self._producer = {out: n for n in self.nodes for out in n.output}
        self._consumers: dict[str, list] = {}
        for n in self.nodes:
            for name in n.input:
                self._consumers.setdefault(name, []).append(n)

    # ---- nodes -------------------------------------------------------------------------------

    def node(self, name: str):
        """The node called `name`, or None."""
        return self._by_name.get(name)

    def producer(self, value: str):
        return self._producer.get(value)

    def consumers(self, value: str) -> list:
        return self._consumers.get(value, [])

    def attr(self, node, name: str, default=None):
        for a in node.attribute:
            if a.name == name:
                value = self._attr(a)
                return value.decode() if isinstance(value, bytes) else value
        return default

    # ---- constant values ----------------------------------------------------------------------

    def is_constant(self, value: str) -> bool:
        return value in self._init or value in self._constants

    def constant(self, value: str, what: str) -> np.ndarray:
        """The array behind a node input; `what` names the tensor it should be, for errors."""
        if value in self._init:
            return np.array(self._to_array(self._init[value]))  # a writable copy
        if value in self._constants:
            attribute = self._constants[value].attribute[0]
            content = self._attr(attribute)
            return np.array(self._to_array(content) if attribute.name == "value" else content)
        raise ModelLoadError(f"{self.path}: tensor {value!r} ({what}) is missing from the file")

    def input_constant(self, node, index: int, what: str) -> tuple[str, np.ndarray]:
        """(name, array) of input `index` of `node`, which must be a stored tensor."""
        if index >= len(node.input) or not node.input[index]:
            raise ModelLoadError(f"{self.path}: node {node.name!r} has no input {index} ({what})")
        name = node.input[index]
        return name, self.constant(name, what)

    def only_constant_input(self, node, what: str) -> tuple[str, np.ndarray]:
        """(name, array) of the one stored-tensor input of a MatMul / Add node."""
        names = [i for i in node.input if self.is_constant(i)]
        if len(names) != 1:
            raise ModelLoadError(f"{self.path}: node {node.name!r} should take exactly one stored tensor "
                                 f"({what}), it takes {len(names)}")
        return names[0], self.constant(names[0], what)


def check_shape(path: Path, onnx_name: str, torch_name: str, array: np.ndarray, shape: tuple) -> np.ndarray:
    if tuple(array.shape) != tuple(shape):
        raise ModelLoadError(f"{path}: tensor {onnx_name!r} (our {torch_name!r}) has shape {tuple(array.shape)}, "
                             f"expected {tuple(shape)}")
    return array
