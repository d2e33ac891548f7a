"""`tltjax.sharding` on 8 virtual CPU devices: sharded forward equals single-device forward; the rule table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tltjax import sharding as shd
from tltjax.models import forward, from_pretrained
from tltjax.models.hf import param_paths

MESHES = {"fsdp2_tensor4": {"fsdp": 2, "tensor": 4}, "data2_tensor4": {"data": 2, "tensor": 4}}
IDS = np.random.RandomState(0).randint(0, 97, (4, 19))


@pytest.fixture(scope="module")
def reference(hf_model):
    """(checkpoint dir, single-device logits) for one family."""
    _, _, path = hf_model
    model = from_pretrained(path, dtype="float32")
    assert len(param_paths(model)["model.norm.weight"][...].devices()) == 1
    return path, np.asarray(forward(model, jnp.asarray(IDS)).logits)


def _expected_shardings(model, mesh):
    """Each parameter's NamedSharding as the rule table prescribes for its logical axes."""
    return {
        name: shd.named_sharding(var.shape, var.get_metadata()["axes"], mesh)
        for name, var in param_paths(model).items()
    }


def _assert_q_proj_sharded(model, mesh):
    """q_proj's weight is split over the mesh: each device holds an eighth of it."""
    w = param_paths(model)["model.layers.0.self_attn.q_proj.weight"][...]
    assert w.sharding.spec != P() and not w.sharding.is_fully_replicated
    want = (w.shape[0] // 4, w.shape[1] // mesh.shape["fsdp"])
    assert len(w.addressable_shards) == 8
    assert all(s.data.shape == want for s in w.addressable_shards)


@pytest.mark.parametrize("mesh_shape", list(MESHES.values()), ids=list(MESHES))
def test_sharded_forward_equals_single_device(reference, mesh_shape):
    """shard_model + use_mesh (activation constraints on) gives the single-device logits to 1e-5."""
    path, ref = reference
    mesh = shd.make_mesh(mesh_shape)
    model = shd.shard_model(from_pretrained(path, dtype="float32"), mesh)
    for name, want in _expected_shardings(model, mesh).items():
        arr = param_paths(model)[name][...]
        assert arr.sharding.is_equivalent_to(want, arr.ndim), (name, arr.sharding, want)
    _assert_q_proj_sharded(model, mesh)
    with shd.use_mesh(mesh):
        out = forward(model, jnp.asarray(IDS)).logits
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)


def test_loading_onto_mesh_gives_rule_shardings_and_same_logits(reference):
    """from_pretrained(mesh=) places each tensor by its rule directly, and the sharded model's logits match."""
    path, ref = reference
    mesh = shd.make_mesh(MESHES["fsdp2_tensor4"])
    model = from_pretrained(path, dtype="float32", mesh=mesh)
    for name, want in _expected_shardings(model, mesh).items():
        got = param_paths(model)[name][...].sharding
        assert isinstance(got, NamedSharding) and got.mesh == mesh and got.spec == want.spec, (name, got, want)
    # Spelled out: Megatron-style tensor parallelism over heads/mlp, FSDP over the hidden dim.
    specs = {
        "model.layers.0.self_attn.q_proj.weight": P("tensor", "fsdp"),
        "model.layers.0.self_attn.o_proj.weight": P("fsdp", "tensor"),
        "model.layers.1.mlp.up_proj.weight": P("tensor", "fsdp"),
        "model.layers.1.mlp.down_proj.weight": P("fsdp", "tensor"),
        "model.embed_tokens.weight": P(None, "fsdp"),  # vocab 97 does not divide over tensor=4
        "model.norm.weight": P(None),
    }
    for name, want in specs.items():
        assert param_paths(model)[name][...].sharding.spec == want, name
    _assert_q_proj_sharded(model, mesh)
    with shd.use_mesh(mesh):
        out = forward(model, jnp.asarray(IDS)).logits
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- the rule table
def test_spec_uses_each_mesh_axis_once():
    """batch takes (data, fsdp), so a later embed (→ fsdp) on the same array is left unsharded."""
    assert shd.spec(("batch", "embed")) == P(("data", "fsdp"), None)
    assert shd.spec(("mlp", "q_heads")) == P("tensor", None)
    assert shd.spec(("q_heads", "embed")) == P("tensor", "fsdp")


def test_spec_drops_size_one_mesh_axes():
    """On a mesh without fsdp (size 1), batch maps to data alone and embed is replicated."""
    mesh = shd.make_mesh({"data": 2, "tensor": 4})
    assert shd.spec(("batch", "embed"), mesh=mesh) == P("data", None)
    assert shd.spec(("batch", "seq", "act_mlp"), mesh=mesh) == P("data", None, "tensor")


def test_indivisible_dims_fall_back_to_replicated():
    """A dimension the mesh axes do not divide (vocab 97 over tensor=4) is replicated; the others keep theirs."""
    mesh = shd.make_mesh({"fsdp": 2, "tensor": 4})
    assert shd.named_sharding((97, 64), ("vocab", "embed"), mesh).spec == P(None, "fsdp")
    assert shd.named_sharding((96, 64), ("vocab", "embed"), mesh).spec == P("tensor", "fsdp")
    assert shd.named_sharding((3, 5), ("batch", None), shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})).spec == P(
        None, None
    )


def test_unknown_logical_axis_is_named():
    """A logical name with no rule raises KeyError naming it."""
    with pytest.raises(KeyError, match="heads_typo"):
        shd.spec(("batch", "heads_typo"))


@pytest.mark.parametrize(
    "shape, match",
    [
        ({"fsdp": 3, "tensor": 4}, "needs 12 devices, 8 given"),
        ({"data": 2, "tensor": 2}, "needs 4 devices, 8 given"),
        ({"fsdp": -1, "tensor": 3}, "8 given"),
        ({"fsdp": -1, "tensor": -1}, "at most one"),
        ((2, 4), "3 sizes"),
    ],
)
def test_make_mesh_rejects_wrong_device_counts(shape, match):
    """A mesh shape that does not multiply out to the device count (or is malformed) raises ValueError."""
    with pytest.raises(ValueError, match=match):
        shd.make_mesh(shape)


def test_make_mesh_fills_minus_one():
    """-1 takes the remaining devices."""
    assert dict(shd.make_mesh({"fsdp": -1, "tensor": 4}).shape) == {"data": 1, "fsdp": 2, "tensor": 4}


def test_constrain_is_active_only_under_use_mesh():
    """Inside use_mesh, constrain lays the activation out by its rule; outside it leaves the array alone.

    The same jitted function is called outside, inside, then outside again with the same
    input: use_mesh must force a retrace, not reuse the trace made without constraints.
    """
    mesh = shd.make_mesh({"data": 2, "tensor": 4})
    f = jax.jit(lambda x: shd.constrain(x * 2, ("batch", "seq", "act_mlp")))
    x = jnp.ones((4, 3, 8))
    assert len(f(x).devices()) == 1
    with shd.use_mesh(mesh):
        y = f(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, "tensor")), 3)
    assert len(f(x).devices()) == 1
