"""Mixture of experts: gating, expert-parallel layer and parameter classification (public: ``deepspeed.moe``)."""
