"""Shared pieces of the public docstrings (jax.lax's layout: a summary, Args, Returns, Raises,
Example).  The examples are doctests run by tests/test_docstrings.py on 8 CPU devices, with
``jax``, ``jnp``, ``np``, ``P`` (PartitionSpec) and ``jax_dfccl`` imported."""
from __future__ import annotations

AXIS_NAME = """axis_name: a mesh axis name bound by ``jax.shard_map`` (or a tuple of them: the
      group is their product, ranks numbered row-major as ``jax.lax.axis_index``), or an
      axis name bound by ``jax.vmap`` (then the op is ``jax.lax``'s: no device communicates)."""

GROUPS = """axis_index_groups: optional list of lists of axis indices: the op runs within each
      group separately (every index exactly once, groups of one size)."""

KEY = """key: optional non-empty string naming the collective across ranks.  Ranks match
      instances by (key, sequence number), never by the order they issue them; by default
      the key is derived from the op, shape, dtype, axes and call site, which suffices
      when every rank runs the same code.  Give one when ranks reach the collective from
      different code (e.g. different branches of a rank-dependent ``lax.switch``)."""

RAISES_AXIS = """NameError: ``axis_name`` is not bound (called outside ``jax.shard_map``).
    TypeError: an argument of the wrong type, or a dtype the op does not support."""

RUNTIME_ERROR = """Failures of the collective itself (a peer that never arrives within
  ``jax_dfccl.config.timeout_s``, ranks that disagree on shapes under one key) are raised
  when the program runs, naming the key, the sequence number and the ranks."""


MESH = """    >>> mesh = jax.sharding.Mesh(jax.devices(), ("x",))"""


def example(call: str, out: str, x: str = "jnp.arange(8.0)", out_specs: str = "P()", show: str = "f(x)") -> str:
  """A doctest: ``call`` (of ``v``) in a jitted shard_map ``f`` over an 8-device axis "x",
  applied to ``x``; ``show`` is printed and gives ``out``."""
  return f"""{MESH}
    >>> f = jax.jit(jax.shard_map(lambda v: {call}, mesh=mesh,
    ...                           in_specs=P("x"), out_specs={out_specs}))
    >>> x = {x}
    >>> print({show})
    {out}
"""


def start_call(call: str) -> str:
  """``jax_dfccl.op(...)`` as ``jax_dfccl.done(jax_dfccl.op_start(...))``."""
  name, rest = call.split("(", 1)
  return f"jax_dfccl.done({name}_start({rest})"


def start_doc(name: str, example: str) -> str:
  """The docstring of ``<name>_start``."""
  return f"""Starts :func:`jax_dfccl.{name}` and returns a handle, without waiting for it.

  The collective runs while the program computes; ``jax_dfccl.done(handle)`` waits for
  it and returns exactly what ``jax_dfccl.{name}`` returns.  Ranks may start and finish
  their collectives in different orders (instances match by key, not by issue order).
  Every start needs exactly one ``done`` in the same traced program.

  Args:
    The arguments of :func:`jax_dfccl.{name}`, the same names and defaults.

  Returns:
    A :class:`jax_dfccl.Handle`, to be passed to :func:`jax_dfccl.done` once.

  Raises:
    The argument errors of :func:`jax_dfccl.{name}`.
    NotImplementedError: under ``jax.grad``/``jax.jvp`` (handles are not differentiable: use
      the blocking form there), or over an axis name bound by ``jax.vmap``.
    ValueError: when the program is lowered, if the handle never reached ``done``.

  Example:
{example}
  """
