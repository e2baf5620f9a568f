"""tests/synthetic.py's model sizes: each has the parameter count its docstring gives (benches quote them)."""

import pytest

import synthetic


@pytest.mark.parametrize("size, millions", [("tiny", 0.1), ("small", 3.3), ("medium", 26), ("large", 58)])
def test_each_model_size_has_the_documented_parameter_count(size, millions):
    model = synthetic.TinyLM(synthetic.ModelSpec.of_size(size))
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(millions * 1e6, rel=0.1)
    assert f"`{size}` (~{millions:g}M" in synthetic.ModelSpec.of_size.__doc__


def test_an_unknown_size_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="expected one of .*'large'.*found 'huge'"):
        synthetic.ModelSpec.of_size("huge")
