"""memsave's small graph-editing layer over live TF2 graphs and FuncGraphs.

walks/filters (select), rerouting (reroute), copying (transform) and a matcher
for tests (match). Only `_tf_private` touches TensorFlow's private APIs.
"""

from memsave.graph.match import OpMatcher
from memsave.graph.reroute import reroute_ts, swap_ts
from memsave.graph.select import (
    TensorMap, TensorSet, filter_ops, filter_ops_by_type, filter_ops_from_regex,
    filter_ts, filter_ts_from_regex, get_backward_walk_ops, get_consuming_ops,
    get_forward_walk_ops, get_generating_ops, get_name_scope_ops, make_list_of_op,
    make_list_of_t, tensor_key, topological_sort)
from memsave.graph.transform import CopyResult, copy_with_input_replacements

__all__ = [
    "OpMatcher", "reroute_ts", "swap_ts", "TensorMap", "TensorSet", "filter_ops",
    "filter_ops_by_type", "filter_ops_from_regex", "filter_ts", "filter_ts_from_regex",
    "get_backward_walk_ops", "get_consuming_ops", "get_forward_walk_ops",
    "get_generating_ops", "get_name_scope_ops", "make_list_of_op", "make_list_of_t",
    "tensor_key", "topological_sort", "CopyResult", "copy_with_input_replacements",
]
