"""memsave's modules import each other in layers, without circles.

Read from the source (ast), every import counted, inside functions too: an import
deferred into a function to dodge a circle is still a circle of the design.
Layers, lowest first: scoped, errors, batch, beside, fresh_process, graph/, region, environment -> planner/ -> strategies/
-> backward, offload, aggregate, report, inputs -> planning -> build -> rewrite ->
integrations/, calibration.
"""

import ast
import os

import memsave

PACKAGE_DIR = os.path.dirname(os.path.abspath(memsave.__file__))

# What each layer may not import (by module-name prefix).
FORBIDDEN = {
    "memsave.graph": ["memsave.region", "memsave.planner", "memsave.strategies", "memsave.planning",
                      "memsave.build", "memsave.rewrite", "memsave.offload"],
    "memsave.region": ["memsave.planner", "memsave.strategies", "memsave.planning",
                       "memsave.build", "memsave.rewrite"],
    "memsave.environment": ["memsave.planner", "memsave.strategies", "memsave.planning",
                            "memsave.build", "memsave.rewrite"],
    "memsave.planner": ["memsave.strategies", "memsave.planning", "memsave.build",
                        "memsave.rewrite", "memsave.offload", "memsave.integrations",
                        "memsave.calibration", "memsave.inputs"],
    "memsave.strategies": ["memsave.planning", "memsave.build", "memsave.rewrite",
                           "memsave.integrations", "memsave.inputs"],
    "memsave.planning": ["memsave.build", "memsave.rewrite", "memsave.integrations"],
    "memsave.plan_variants": ["memsave.planning", "memsave.build", "memsave.rewrite",
                              "memsave.strategies", "memsave.integrations"],
    "memsave.build": ["memsave.planning", "memsave.rewrite", "memsave.planner",
                      "memsave.strategies", "memsave.integrations"],
    "memsave.rewrite": ["memsave.integrations", "memsave.calibration", "memsave.tape"],
    "memsave.ordering": ["memsave.planner", "memsave.strategies", "memsave.planning",
                         "memsave.build", "memsave.rewrite"],
    "memsave.xla_gates": ["memsave.planner", "memsave.strategies", "memsave.planning",
                          "memsave.build", "memsave.rewrite", "memsave.ordering"],
    "memsave.tape": ["memsave.integrations", "memsave.calibration"],
    # The memory model, lowest first: timeline -> forward_pass, schedule -> simulate_plan
    # -> simulate -> memory (the surface) -> search.
    "memsave.planner.timeline": ["memsave.planner.forward_pass", "memsave.planner.schedule",
                                 "memsave.planner.simulate", "memsave.planner.simulate_plan",
                                 "memsave.planner.memory", "memsave.planner.search"],
    "memsave.planner.forward_pass": ["memsave.planner.simulate", "memsave.planner.simulate_plan",
                                     "memsave.planner.memory", "memsave.planner.search"],
    "memsave.planner.schedule": ["memsave.planner.simulate", "memsave.planner.simulate_plan",
                                 "memsave.planner.memory", "memsave.planner.search"],
    "memsave.planner.simulate_plan": ["memsave.planner.simulate", "memsave.planner.memory",
                                      "memsave.planner.search"],
    "memsave.planner.simulate": ["memsave.planner.memory", "memsave.planner.search"],
    # The facts of op types: plain data, below everything of memsave that reads them.
    "memsave.planner.op_facts": ["memsave.planner", "memsave.graph", "memsave.region",
                                 "memsave.environment", "memsave.strategies",
                                 "memsave.ordering", "memsave.planning", "memsave.build",
                                 "memsave.rewrite"],
    # What StepGraph.build calls, and the kinds of ops they read: below the StepGraph.
    "memsave.planner.op_kinds": ["memsave.planner.graph", "memsave.planner.memory",
                                 "memsave.planner.search"],
    "memsave.planner.deferral": ["memsave.planner.graph", "memsave.planner.memory",
                                 "memsave.planner.search"],
    "memsave.planner.buffer_links": ["memsave.planner.graph", "memsave.planner.memory",
                                     "memsave.planner.search"],
    "memsave.planner.constant_folding": ["memsave.planner.graph", "memsave.planner.memory",
                                         "memsave.planner.search"],
    "memsave.planner.candidates": ["memsave.planner.search", "memsave.planner.memory"],
    # Which tensors a budget keeps to recompute less: read off the StepGraph alone.
    "memsave.planner.expensive": ["memsave.planner.search", "memsave.planner.memory",
                                  "memsave.planner.simulate", "memsave.strategies"],
    # A budget's local search: it drives the search's predictions, never the search itself.
    "memsave.planner.local_search": ["memsave.planner.search", "memsave.planner.memory",
                                     "memsave.strategies"],
    # The replay of a gradient built apart, on a Timeline: below the StepGraph that
    # calls it, and the step's simulation.
    "memsave.planner.function_run": ["memsave.planner.graph", "memsave.planner.simulate",
                                     "memsave.planner.memory", "memsave.planner.search"],
    # What each platform's kernels allocate (read by StepGraph.build): below the StepGraph.
    "memsave.planner.kernels": ["memsave.planner.graph", "memsave.planner.memory",
                                "memsave.planner.simulate", "memsave.planner.search"],
    # What batch fits: traces steps that call memsave; nothing of the integrations.
    "memsave.capacity": ["memsave.integrations", "memsave.calibration", "memsave.planning",
                         "memsave.build"],
    # The batch a step is planned for: read by rewrite, set by the Keras integration.
    "memsave.batch": ["memsave.graph", "memsave.region", "memsave.planner", "memsave.strategies",
                      "memsave.planning", "memsave.build", "memsave.rewrite",
                      "memsave.integrations"],
    # What a training step holds beside its gradients, and the scoped values both use.
    "memsave.beside": ["memsave.graph", "memsave.region", "memsave.planner", "memsave.strategies",
                       "memsave.planning", "memsave.build", "memsave.rewrite",
                       "memsave.integrations"],
    "memsave.scoped": ["memsave.errors", "memsave.batch", "memsave.beside", "memsave.graph",
                       "memsave.region", "memsave.planner", "memsave.rewrite",
                       "memsave.integrations"],
    # Processes for measurements: nothing of the rewrite.
    "memsave.fresh_process": ["memsave.graph", "memsave.region", "memsave.planner",
                              "memsave.strategies", "memsave.planning", "memsave.build",
                              "memsave.rewrite", "memsave.integrations", "memsave.measure"],
}


def _modules():
    """Module name -> source path, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if not name.endswith(".py"):
                continue
            relative = os.path.relpath(os.path.join(folder, name), os.path.dirname(PACKAGE_DIR))
            module = relative[:-3].replace(os.sep, ".")
            if module.endswith(".__init__"):
                module = module[:-len(".__init__")]
            found[module] = os.path.join(folder, name)
    return found


def _imports(module, path, modules):
    """The memsave modules `module` imports (a package's own __init__ only where the
    importer lies outside the package; the root package never: every module is
    imported through it)."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                names.add(candidate if candidate in modules else base)
    result = set()
    for name in names:
        if name not in modules or name in ("memsave", module):
            continue
        owner = name if modules[name].endswith("__init__.py") else None
        if owner and (module + ".").startswith(owner + "."):
            continue  # (a module of the package importing its own package)
        result.add(name)
    return result


def _import_graph():
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _find_cycle(graph):
    """One import circle, as a list of modules, or None."""
    state = {}

    def visit(module, stack):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target, stack)
                if cycle:
                    return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [])
            if cycle:
                return cycle
    return None


def test_no_import_circles():
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_upward_imports():
    violations = []
    for module, targets in _import_graph().items():
        for layer, banned in FORBIDDEN.items():
            if module != layer and not module.startswith(layer + "."):
                continue
            violations += [f"{module} imports {t}" for t in targets
                           if any(t == b or t.startswith(b + ".") for b in banned)]
    assert not violations, violations


def test_the_checker_finds_a_circle():
    """(The checker itself: a circle and an upward import are found.)"""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    modules = _modules()
    assert "memsave.planner.costs" in _imports("memsave.planner.memory",
                                               modules["memsave.planner.memory"], modules)
