"""Every use of TensorFlow's private graph APIs lives here, and only here.

These calls (`Operation._update_input`, `Operation._add_control_inputs`,
`Graph._create_op_internal`, ...) are what graph surgery needs and what TF 2.x
no longer exposes publicly. Keeping them in one module means a TensorFlow upgrade
that changes them breaks one file, and the rest of memsave reads as public API.
"""

from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import default_gradient


def update_input(op, index, tensor):
    """Makes input `index` of `op` read `tensor` (in place)."""
    op._update_input(index, tensor)


def add_control_inputs(op, control_ops):
    """Adds `control_ops` as control inputs of `op`, skipping ones it already has and
    ones whose outputs it reads: those order nothing, and Grappler's arithmetic optimizer
    gave a Neg that read another Neg both ways the wrong sign (fuzz seed 9763)."""
    existing = set(op.control_inputs) | {t.op for t in op.inputs}
    new = [c for c in control_ops if c not in existing and c is not op]
    if new:
        op._add_control_inputs(new)


def remove_control_inputs(op):
    """Removes every control input of `op` (in place)."""
    op._remove_all_control_inputs()


def creation_index(op):
    """A number that grows with every op its graph creates: ops made after `op` have
    larger ones."""
    return op._id


def a_tape_is_recording():
    """Whether a tf.GradientTape (or a forward accumulator) is recording now: ops it
    records must be made through TensorFlow's op wrappers, which the graph editor's
    copies are not."""
    from tensorflow.python.eager import record
    return bool(record.could_possibly_record())


def ops_made(graph):
    """The creation index of the last op `graph` made (0 before any): ops made later have
    larger ones."""
    return max(graph._nodes_by_id, default=0)


def ops_made_after(graph, index):
    """The ops `graph` made after the op of creation index `index`, in creation order."""
    made = graph._nodes_by_id
    return [made[i] for i in range(index + 1, ops_made(graph) + 1) if i in made]


def original_op(op):
    """The op TensorFlow names as where `op` came from (a gradient op's forward op), or
    None."""
    return op._original_op


def set_original_op(op, original):
    """Names `original` as where `op` came from: TensorFlow's error messages about `op`
    then point at it."""
    op._original_op = original


def colocate(op, with_op):
    """Puts `op` in `with_op`'s colocation groups: the `_class` attribute the placer reads,
    and that gradient ops built under `colocate_with(op)` inherit."""
    groups = attr_value_pb2.AttrValue.ListValue(s=with_op.colocation_groups())
    op._set_attr("_class", attr_value_pb2.AttrValue(list=groups))


def control_outputs(op):
    """The ops that have `op` as a control input."""
    return list(op._control_outputs)


def create_op_like(op, inputs, name, graph=None):
    """Creates a new op with the type, attributes and device of `op`.

    Args:
      op: the op to imitate.
      inputs: the data inputs of the new op.
      name: the wanted name; made unique by the graph.
      graph: where to create it (default `op.graph`).
    Returns:
      The new `tf.Operation`.
    """
    graph = op.graph if graph is None else graph
    attrs = {key: op.node_def.attr[key] for key in op.node_def.attr}
    outputs = op.outputs
    inference = _inference_call(op)
    if inference is not None:
        attrs, outputs = _as_inference_call(attrs, outputs, *inference)
    new_op = graph._create_op_internal(
        op.type, list(inputs), dtypes=[t.dtype for t in outputs], name=name,
        attrs=attrs, op_def=op.op_def, compute_device=False)
    if op.device:
        new_op._set_device(op.device)
    if op._gradient_function is not None:
        # A tf.function call's gradient lives on the Python op (it rewrites that call
        # to also output what its backward function reads): the copy takes it too.
        new_op._gradient_function = op._gradient_function
    return new_op


def _inference_call(op):
    """(inference function name, its output count) of a tf.function call op whose
    gradient tf.gradients already took: that rewrote the op to call a forward function
    with extra outputs for its backward function. None for any other op."""
    delayed = getattr(op._gradient_function, "__self__", None)
    inference = getattr(delayed, "_inference_function", None)
    if inference is None or "f" not in op.node_def.attr:
        return None
    name = inference.name.decode() if isinstance(inference.name, bytes) else inference.name
    if op.node_def.attr["f"].func.name == name:
        return None
    return name, len(inference.cached_definition.signature.output_arg)


def _as_inference_call(attrs, outputs, name, count):
    """A copy of a rewritten call calls the inference function again, with its outputs
    only: its gradient is then the backward function tf.gradients built for the
    original (cached, the same numbers), not a second one for the extra outputs."""
    attrs = dict(attrs)
    function = attr_value_pb2.AttrValue()
    function.CopyFrom(attrs["f"])
    function.func.name = name
    attrs["f"] = function
    types = attr_value_pb2.AttrValue()
    types.list.type.extend(attrs["Tout"].list.type[:count])
    attrs["Tout"] = types
    return attrs, outputs[:count]


def call_gradient_graphs(op):
    """(forward, backward): the graphs of the functions tf.gradients rewrites tf.function
    call op `op` to call and calls for its gradient, which TensorFlow builds and caches
    for that gradient; None where `op` has no such gradient or has been rewritten
    already. The forward function's outputs are the call's own and then the
    intermediates the backward function reads; the backward function's inputs are the
    gradients of the call's trainable outputs and then its captures (`.captures`:
    those intermediates, as tensors of the forward function, and whatever else it
    captured). Nothing is added to `op`'s graph."""
    delayed = getattr(op._gradient_function, "__self__", None)
    if not hasattr(delayed, "forward_backward") or _inference_call(op) is not None:
        return None
    forward, backward = delayed.forward_backward(len(op.outputs))
    graphs = getattr(forward, "graph", None), getattr(backward, "graph", None)
    return None if None in graphs else graphs


def is_trainable(t):
    """Whether TensorFlow gives tensor `t` a gradient (backprop_util.IsTrainable: a
    floating, complex, resource or variant tensor): a call's backward function takes
    the gradients of its trainable outputs only."""
    from tensorflow.python.eager import backprop_util
    return backprop_util.IsTrainable(t)


def function_definition(graph, name):
    """The FunctionDef named `name` in `graph`'s function library (or an outer graph's),
    or None where there is none."""
    function = graph._get_function(name)
    if function is None:
        return None
    return getattr(function, "cached_definition", None) or function.definition


def control_flow_context(op):
    """The v1 control-flow context (cond or while frame) of `op`, or None.

    The XLA context TensorFlow puts around a jit-compiled function's body is no
    such frame and is skipped."""
    context = op._get_control_flow_context()
    while context is not None and context.IsXLAContext():
        context = context.outer_context
    return context


def building_in_control_flow(graph):
    """Whether ops built in `graph` now go into a v1 control-flow frame (the body of a v1
    tf.while_loop or tf.cond being built: tf.hessians' loop under TF1 behaviour)."""
    context = graph._get_control_flow_context()
    while context is not None and context.IsXLAContext():
        context = context.outer_context
    return context is not None


def is_func_graph(graph):
    """True for a `tf.function` body (a FuncGraph)."""
    return getattr(graph, "building_function", False)


def graph_tensor_of_variable(variable, graph):
    """The tensor that stands for `variable`'s handle inside `graph`.

    In a tf.compat.v1 graph that is `variable.handle`; inside a `tf.function`, an
    outer variable's handle is an eager tensor and the body's own tensor is the
    graph's capture of it.
    """
    handle = getattr(variable, "handle", None)
    if handle is None:
        # A v1 ref variable (use_resource=False) has no handle; tf.gradients
        # differentiates with respect to its ref tensor.
        return tf_ops.convert_to_tensor(variable, as_ref=True)
    if getattr(handle, "graph", None) is graph:
        return handle
    if is_func_graph(graph) and isinstance(handle, tf_ops.EagerTensor):
        return graph.capture(handle)
    return handle


def in_xla_context(graph):
    """Whether ops built in `graph` will be compiled by XLA: the body of a
    tf.function(jit_compile=True), or of a function it calls (TensorFlow marks the
    graph that calls a jit-compiled function with an XLA control-flow context)."""
    from tensorflow.python.ops import control_flow_util
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def is_eager_tensor(value):
    return isinstance(value, tf_ops.EagerTensor)


def zero_gradient_like(x):
    """The zero gradient tf.gradients gives an unconnected x (resource handles included)."""
    return default_gradient.zeros_like(x)


def onednn_enabled():
    """Whether TensorFlow's oneDNN CPU kernels are on in this process (the default on
    many x86 CPUs; TF_ENABLE_ONEDNN_OPTS=0/1 decides). TensorFlow's own kernels,
    used otherwise, allocate large im2col temporaries in convolution gradients."""
    from tensorflow.python.util import _pywrap_util_port
    return bool(_pywrap_util_port.IsMklEnabled())


def overridden_gradient_type(op):
    """The name an op's gradient was registered under where it is not its type's own
    (a `tf.custom_gradient`, or `Graph.gradient_override_map`), else None."""
    # (Read from the NodeDef: get_attr raises for the ops that have no such attr, which
    # are nearly all of them, and that costs 8 us an op where this costs 1.)
    attrs = op.node_def.attr
    return attrs["_gradient_op_type"].s.decode() if "_gradient_op_type" in attrs else None


def gradient_reads_a_closure(op):
    """Whether `op`'s gradient was registered for it alone by a Python closure (a
    `tf.custom_gradient`): that function reads the tensors the closure holds, not the
    op's inputs, so it only works for `op` itself."""
    gradient_type = overridden_gradient_type(op)
    if gradient_type is None:
        return False
    try:
        function = tf_ops.gradient_registry.lookup(gradient_type)
    except LookupError:
        return False
    return bool(getattr(function, "__closure__", None))


def gradient_function(op):
    """The Python function tf.gradients calls for `op`'s gradient (None: none)."""
    return tf_ops.get_gradient_function(op)


def scratch_graph(outer, name):
    """A function graph inside `outer` to build throwaway ops in: tensors of `outer`
    that its ops read become its captures (`.captures`: (outer tensor, placeholder)
    pairs), and nothing is added to `outer`."""
    from tensorflow.python.framework import func_graph
    with outer.as_default():
        return func_graph.FuncGraph(name)


# -- while_v2 loops (memsave.graph.loops) -----------------------------------------------

def loop_output_shapes(loop):
    """The static shapes of a while_v2 loop op's loop variables (its `output_shapes`)."""
    from tensorflow.python.framework import tensor_shape
    return [tensor_shape.TensorShape(s) for s in loop.get_attr("output_shapes")]


def loop_function_graph(loop, attr, shapes):
    """A new function graph read back from the library function a while_v2 loop op names
    in `attr` ('cond' or 'body'), its inputs shaped `shapes`: ops added to it change
    neither the loop nor its function."""
    from tensorflow.python.ops import control_flow_util_v2
    return control_flow_util_v2.get_func_graph(loop, shapes, loop.get_attr(attr).name)


def loop_body_to_read(loop, shapes):
    """A graph of a while_v2 loop's body to read, never to change: the one Python built
    (static shapes TensorFlow could not write into the function: a Split's outputs) where
    the op has it, else one read back from the library."""
    body = getattr(loop, "_body_graph", None)
    return body if body is not None else loop_function_graph(loop, "body", shapes)


def unique_function_name(prefix):
    """A function name no function of this process has (as TensorFlow names its own)."""
    from tensorflow.python.ops import control_flow_util_v2
    return control_flow_util_v2.unique_fn_name("", prefix)


def rename_function_graph(func_graph, prefix):
    """Gives `func_graph` a unique name, under which it will be added to the library."""
    func_graph.name = unique_function_name(prefix)


def new_loop_body_graph(outer, name):
    """An empty graph for a loop body, inside `outer`, of the class while_v2 gives its
    own bodies: TensorFlow's gradient then makes the zero gradients of a body tensor from
    its static shape instead of keeping the tensor for its shape."""
    from tensorflow.python.ops import control_flow_v2_func_graphs
    with outer.as_default():
        return control_flow_v2_func_graphs.WhileBodyFuncGraph(name)


def set_function_graph_io(func_graph, inputs, outputs):
    """Makes `inputs` (placeholders) and `outputs` the arguments and results of the
    function `func_graph` will be added to the library as."""
    func_graph.inputs = list(inputs)
    func_graph.outputs = list(outputs)


def placeholder_like(t):
    """A placeholder of `t`'s dtype and shape (a variable handle's data included) in the
    default graph, named after `t`'s op."""
    from tensorflow.python.ops import array_ops, handle_data_util
    placeholder = array_ops.placeholder(t.dtype, t.shape, name=t.op.name)
    if t.dtype.name == "resource":
        handle_data_util.copy_handle_data(t, placeholder)
    return placeholder


def list_element_dtype(t):
    """The element dtype of TensorList `t` where its handle data says, else None."""
    from tensorflow.python.ops import handle_data_util
    if t.dtype != dtypes.variant:
        return None
    data = handle_data_util.get_resource_handle_data(t)
    if data is None or not data.is_set or len(data.shape_and_type) != 1:
        return None
    return dtypes.as_dtype(data.shape_and_type[0].dtype)


def empty_list_like(t, element_dtype):
    """A TensorList as long as `t` whose elements are all unset: a zero gradient for
    `t` that allocates nothing (TensorFlow adds a list to it element by element, an
    unset element as zero). tf.gradients' own zero gradient of a list, its zeros_like,
    makes every element."""
    from tensorflow.python.ops import gen_list_ops
    return gen_list_ops.tensor_list_reserve(
        gen_list_ops.tensor_list_element_shape(t, shape_type=dtypes.int32),
        gen_list_ops.tensor_list_length(t), element_dtype=element_dtype)


def build_loop(like, cond_graph, body_graph, name, parallel_iterations=None):
    """A while_v2 loop op with `like`'s inputs, attributes and output shapes, running
    `cond_graph` and `body_graph` (added to the library as they are named), built as
    tf.while_loop builds its own, so TensorFlow's gradient takes it as one.
    `parallel_iterations`: how many iterations may run at once (default `like`'s); the
    loop's gradient takes it too."""
    if parallel_iterations is None:
        parallel_iterations = like.get_attr("parallel_iterations")
    with like.graph.as_default():
        outputs = build_loop_from(like, like.inputs, cond_graph, body_graph, name,
                                  parallel_iterations)
    return outputs[0].op


def build_loop_from(like, inputs, cond_graph, body_graph, name, parallel_iterations):
    """The outputs of a while_v2 loop op reading `inputs` (as many as `like`'s, of the
    same dtypes and shapes) in the default graph, running `cond_graph` and `body_graph`,
    with `like`'s output shapes. The new loop reads `like`'s resource inputs as `like`
    does (its `_read_only_resource_inputs`: TensorFlow derives it from what each op of
    the body does with a handle, and would count memsave's pass-through of one as a
    write)."""
    from tensorflow.python.ops import while_v2
    outputs = while_v2._build_while_op(
        list(inputs), cond_graph, body_graph, output_shapes=loop_output_shapes(like),
        parallel_iterations=parallel_iterations, name=name,
        num_original_outputs=len(like.outputs))
    read_only = "_read_only_resource_inputs"
    if read_only in like.node_def.attr:
        outputs[0].op._set_attr(read_only, like.node_def.attr[read_only])
    return list(outputs)


def memory_profile(logdir):
    """The memory profile of the profiler trace written under `logdir` (what TensorBoard's
    memory tool shows: per allocator, the allocations alive at its peak, with the op that
    made each), as the parsed JSON, or None where this TensorFlow cannot convert it."""
    import glob
    import json
    try:  # (TensorFlow 2.16 names the converter's module _pywrap_profiler)
        from tensorflow.python.profiler.internal import _pywrap_profiler_plugin as converter
    except ImportError:
        from tensorflow.python.profiler.internal import _pywrap_profiler as converter
    paths = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
    if not paths or not hasattr(converter, "xspace_to_tools_data"):
        return None
    data, ok = converter.xspace_to_tools_data(paths, "memory_profile", {})
    return json.loads(data) if ok and data else None


def profiler_spaces(logdir):
    """The XSpace protos of the profiler traces written under `logdir` (every event the
    profiler recorded, its memory allocations and deallocations included; the memory
    profile of memory_profile keeps at most 1000 of them)."""
    import glob
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError:  # (where TensorFlow keeps it elsewhere)
        from tensorflow.core.profiler.protobuf import xplane_pb2
    spaces = []
    for path in sorted(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as trace:
            space.ParseFromString(trace.read())
        spaces.append(space)
    return spaces


def fresh_function(step, traced_graphs):
    """A new tf.function of `step`'s Python function with `step`'s options (XLA,
    AutoGraph, input signature) and none of its traces, which adds the graph of each
    trace it makes to the set `traced_graphs`; `step` itself where it is not a
    tf.function."""
    import tensorflow as tf
    if not hasattr(step, "python_function") or not hasattr(step, "_clone"):
        return step
    python_function = step.python_function

    def traced(*args, **kwargs):
        traced_graphs.add(tf.compat.v1.get_default_graph())
        return python_function(*args, **kwargs)

    return step._clone(traced)


def called_function_graph(call):
    """A graph of the function call op `call` runs (its `f`), its inputs shaped as the
    call's, to read; None where the library has no such function."""
    from tensorflow.python.framework import function_def_to_graph
    definition = function_definition(call.graph, call.get_attr("f").name)
    if definition is None:
        return None
    return function_def_to_graph.function_def_to_graph(
        definition, input_shapes=[t.shape for t in call.inputs])


def compiled_by_xla(call):
    """Whether call op `call`'s function is compiled by XLA (jit_compile=True)."""
    attr = "_XlaMustCompile"
    if attr in call.node_def.attr and call.node_def.attr[attr].b:
        return True
    definition = function_definition(call.graph, call.get_attr("f").name)
    return (definition is not None and attr in definition.attr
            and definition.attr[attr].b)


def resource_value_shape(handle):
    """The static shape of the value a resource tensor (a variable's handle) holds, as its
    handle data says, or None."""
    value = resource_value(handle)
    return None if value is None else value[0]


def resource_value(handle):
    """(static shape, dtype) of the value a resource tensor (a variable's handle, or a
    function's placeholder capturing one) holds, as its handle data says, or None."""
    from tensorflow.python.framework import tensor_shape
    from tensorflow.python.ops import handle_data_util
    data = handle_data_util.get_resource_handle_data(handle)
    if data is None or not data.is_set or not data.shape_and_type:
        return None
    shape_and_type = data.shape_and_type[0]
    return tensor_shape.TensorShape(shape_and_type.shape), dtypes.as_dtype(shape_and_type.dtype)


def gpu_memory_bytes():
    """The bytes TensorFlow's allocator may take on GPU:0 (its virtual device's limit, or
    what TensorFlow found free when it started the device), or None without a GPU. No
    public API says it: device_lib lists the devices with their `memory_limit`."""
    from tensorflow.python.client import device_lib
    for device in device_lib.list_local_devices():
        if device.device_type == "GPU":
            return int(device.memory_limit)
    return None
