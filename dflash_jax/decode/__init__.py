"""The generation programs (prefill + one `lax.while_loop`), one draft step for either drafter kind, sampling and
rejection sampling, and the result type."""
