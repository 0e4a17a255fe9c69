"""The deploy tests' fixture (their helpers: kube.py)."""

import pytest

import kube


@pytest.fixture(scope="module", params=kube.RENDERS)
def objects(request):
    """The objects of each overlay, as ``kubectl kustomize`` renders them (and
    of the gpu overlay with every component it leaves out)."""
    return kube.renders()[request.param]
