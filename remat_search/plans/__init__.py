"""Plans: the policy kinds, the per-layer plan and its export forms."""
