"""Recovery after a rollback: options applied over the updates after the resume."""
