"""Speculative decoding (README.md): the engine core and rl/ reach it only through these names."""
from rollout.speculative.proposers import Proposal, Proposer
from rollout.speculative.spec_accept import accept
from rollout.speculative.speculation import Sample, Speculator, Verification

__all__ = ["Proposal", "Proposer", "Sample", "Speculator", "Verification", "accept"]
