//! Why a [`super::MooncakeStore`] could not be built.

/// Why the Mooncake adapter could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MooncakeError {
    /// The venv, its Python, the package or a binary is missing.
    #[error("Mooncake unavailable: {reason}")]
    Unavailable { reason: String },
    /// The sidecar did not come up (setup, registration or the socket failed).
    #[error("Mooncake unavailable: the sidecar did not start: {detail}")]
    Startup { detail: String },
    /// The configuration cannot work.
    #[error("Mooncake configuration: {detail}")]
    Config { detail: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_displays() {
        let e = MooncakeError::Unavailable { reason: "no venv".into() };
        assert_eq!(e.to_string(), "Mooncake unavailable: no venv");
        let e = MooncakeError::Startup { detail: "setup returned -1".into() };
        assert_eq!(
            e.to_string(),
            "Mooncake unavailable: the sidecar did not start: setup returned -1"
        );
        let e = MooncakeError::Config { detail: "tiny buffer".into() };
        assert_eq!(e.to_string(), "Mooncake configuration: tiny buffer");
    }
}
