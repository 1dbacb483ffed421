"""Models own their weights and math: the MLA verifier and the EAGLE-3 draft."""
from workbench.models.draft import Eagle3Draft
from workbench.models.verifier import Verifier, VerifierOutput

__all__ = ["Eagle3Draft", "Verifier", "VerifierOutput"]
