"""The package functions one micro-batch of ``fit`` passes through, up to the inner apply.

For each way ``fit`` runs a group (graph and XLA, data of known and of
unknown length, ``GradientAccumulateModel`` and ``GradientAccumulateOptimizer``
in a plain ``keras.Model``), one ``fit`` of one group of two micro-batches on
a small dense model, traced with a profiler hook: every call of a function
of the package (``gradient_accumulator/``) from the train function's first
until the inner optimizer's ``apply`` is entered. Prints per configuration:

- **path**: the distinct package functions called on the way, in the order
  of their first call (a function called twice counts once), and their
  modules;
- **stack**: the package functions on the stack at ``apply``;
- **calls back up**: calls from a module to one that imports it (a module
  whose function calls back into its caller's layer), e.g. ``weighting`` ->
  ``engine`` where ``engine`` imports ``weighting``.

The figures describe the code's structure, not its speed: tracing runs each
Python function of the step once. ``--replicas 2`` runs the same under
``MirroredStrategy`` over two logical CPUs (graph mode only: XLA is refused
with several replicas); run it in a fresh process. There each replica's
function runs in a thread of its own, whose stacks start at the thread: the
frames that called ``strategy.run`` are not on them, so its figures count
the replica's part of the way only.

Run: ``python -m tests.scripts.call_path`` (~20 s; ``--verbose`` lists each
path); ``--replicas 2``; ``--quick``: graph mode, known length, the model
wrapper. ``tests/test_runner.py`` keeps the one-device graph path of the
model wrapper within its bound.
"""

import argparse
import ast
import json
import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIR = os.path.join(ROOT, "gradient_accumulator")

WRAPPERS = ("model", "optimizer")
LENGTHS = ("known", "unknown")
MODES = ("graph", "xla")


def _module_of(filename):
    if not filename.startswith(PACKAGE_DIR + os.sep):
        return None
    return os.path.splitext(os.path.relpath(filename, PACKAGE_DIR))[0].replace(os.sep, ".")


def _imports():
    """Per package module, the package modules it imports (from its source)."""
    imports = {}
    for name in os.listdir(PACKAGE_DIR):
        if not name.endswith(".py"):
            continue
        module = name[:-3]
        with open(os.path.join(PACKAGE_DIR, name)) as source:
            tree = ast.parse(source.read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "gradient_accumulator"
            ):
                parts = (node.module or "").split(".")
                if len(parts) > 1:
                    found.add(parts[1])
                else:
                    found.update(alias.name for alias in node.names)
        imports[module] = found
    return imports


def _qualname(code):
    """A function's qualified name (Python >= 3.11), or its name."""
    return getattr(code, "co_qualname", code.co_name)


# Comprehensions are frames of their own before Python 3.12 (PEP 709), not
# functions of the design: left out, so that the figures do not depend on
# the Python version.
_COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def _counted(code):
    return code.co_name not in _COMPREHENSIONS


def _package_stack(frame):
    """The package functions on the stack at ``frame``, outermost first."""
    stack = []
    while frame is not None:
        module = _module_of(frame.f_code.co_filename)
        if module is not None and _counted(frame.f_code):
            stack.append(f"{module}.{_qualname(frame.f_code)}")
        frame = frame.f_back
    return stack[::-1]


class _Recorder:
    """A ``sys.setprofile`` hook: package calls until the inner optimizer's apply.

    And the package stack at each point of a micro-batch's way (the first
    time each is reached): the model's forward pass (``__call__`` of the
    model), its loss (``compute_loss``), the gradient (``GradientTape.gradient``),
    the add into the sums (``engine._add_in_place``) and the inner ``apply``.
    """

    def __init__(self, model):
        self.model = model
        self.calls = []  # (caller module, module, function), in call order
        self.stack = None  # package frames at apply
        self.points = {}  # point -> package stack
        self.recording = False

    def _point(self, name, frame):
        if name not in self.points:
            self.points[name] = _package_stack(frame)

    def __call__(self, frame, event, arg):
        if event != "call" or not self.recording:
            return
        module = _module_of(frame.f_code.co_filename)
        code = frame.f_code.co_name
        if module is None:
            if code in ("__call__", "compute_loss") and frame.f_locals.get("self") is self.model:
                self._point("forward" if code == "__call__" else "loss", frame.f_back)
            elif code == "gradient" and "GradientTape" in type(frame.f_locals.get("self")).__name__:
                self._point("gradient", frame.f_back)
            return
        if code == "_add_in_place":
            self._point("add", frame)
        caller = frame.f_back
        caller_module = None
        while caller is not None:
            caller_module = _module_of(caller.f_code.co_filename)
            if caller_module is not None:
                break
            caller = caller.f_back
        if _counted(frame.f_code):
            self.calls.append((caller_module, module, _qualname(frame.f_code)))

    def at_apply(self):
        if self.stack is not None:
            return
        self.recording = False
        self.stack = _package_stack(sys._getframe(2))
        self.points["apply"] = self.stack


def measure(wrapper, length, mode, strategy=None):
    import keras
    import numpy as np
    import tensorflow as tf

    from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        outputs = keras.layers.Dense(1)(hidden)
        if wrapper == "model":
            model = GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)
            model.compile(optimizer="sgd", loss="mse", jit_compile=mode == "xla")
            return model, model.optimizer
        model = keras.Model(inputs, outputs)
        optimizer = GradientAccumulateOptimizer(keras.optimizers.SGD(), accum_steps=2)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=mode == "xla")
        return model, optimizer.inner_optimizer

    if strategy is not None:
        with strategy.scope():
            model, inner = build()
    else:
        model, inner = build()
    x = np.random.default_rng(0).normal(size=(8, 8)).astype("float32")
    y = x[:, :1]
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    if length == "unknown":
        data = data.filter(lambda *_: True)
    recorder = _Recorder(model)
    apply = inner.apply

    def recorded_apply(*args, **kwargs):
        recorder.at_apply()
        return apply(*args, **kwargs)

    inner.apply = recorded_apply

    class Start(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            recorder.recording = recorder.stack is None

    # MirroredStrategy runs each replica's function in a thread of its own.
    threading.setprofile(recorder)
    sys.setprofile(recorder)
    try:
        model.fit(data, epochs=1, verbose=0, callbacks=[Start()])
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    called = []
    for _, module, function in recorder.calls:
        name = f"{module}.{function}"
        if name not in called:
            called.append(name)
    missing = {"forward", "loss", "gradient", "add", "apply"} - set(recorder.points)
    if missing:
        raise RuntimeError(f"the micro-batch's way did not reach {sorted(missing)}")
    # The way: every package function on the stack at one of its points, in
    # the order of their first call.
    on_the_way = {name for stack in recorder.points.values() for name in stack}
    path = [name for name in called if name in on_the_way]
    imports = _imports()
    back_up = sorted(
        {
            f"{caller} -> {module}.{function}"
            for caller, module, function in recorder.calls
            if caller is not None
            and caller != module
            and caller in imports.get(module, set())
            and module not in imports.get(caller, set())
        }
    )
    return {
        "path": path,
        "points": sorted(recorder.points),
        "called": len(called),
        "modules": sorted({name.split(".")[0] for name in path}),
        "stack": recorder.stack or [],
        "calls_back_up": back_up,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one configuration (CI)")
    parser.add_argument("--replicas", type=int, default=1, help="1, or 2 logical CPUs")
    parser.add_argument("--verbose", action="store_true", help="print every path")
    args = parser.parse_args(argv)
    if args.replicas not in (1, 2):
        parser.error(f"`--replicas` must be 1 or 2. Received: --replicas={args.replicas}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    strategy = None
    if args.replicas == 2:
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    modes = ("graph",) if args.quick or strategy is not None else MODES
    lengths = ("known",) if args.quick else LENGTHS
    wrappers = ("model",) if args.quick else WRAPPERS
    results = {}
    print(
        f"{'configuration':40s} {'path':>4s} {'modules':>7s} {'stack':>5s} {'called':>6s}"
        "  calls back up"
    )
    for wrapper in wrappers:
        for length in lengths:
            for mode in modes:
                name = f"{wrapper}, {mode}, {length} length, {args.replicas} replica(s)"
                figures = measure(wrapper, length, mode, strategy)
                results[name] = figures
                print(
                    f"{name:40s} {len(figures['path']):4d} {len(figures['modules']):7d} "
                    f"{len(figures['stack']):5d} {figures['called']:6d}  "
                    f"{len(figures['calls_back_up'])}"
                )
                if args.verbose:
                    print("  path:  " + "\n         ".join(figures["path"]))
                    print("  stack: " + "\n         ".join(figures["stack"]))
                    for call in figures["calls_back_up"]:
                        print(f"  back up: {call}")
    print("RESULTS " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
