//! Export names as clients send them: raw bytes, which become a name
//! only here. Every routing mode (one `--upstream`, `--export`,
//! `--export-dir`) and the policy see a name that passed `export_name`,
//! so what the policy judges is exactly what the upstream is asked for:
//! no NUL for a C server to stop at (opening the prefix the policy never
//! saw), no invalid UTF-8 for a lossy conversion to paper over, no
//! control characters to hide in logs or file names.

use thiserror::Error;

use super::consts::MAX_EXPORT_NAME;

/// Why bytes are not an export name. The messages are what the client is
/// told (they name no path and echo nothing back).
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum NameError {
    #[error("export names are at most 4096 bytes")]
    TooLong(usize),
    #[error("export names may not hold a NUL byte")]
    Nul,
    #[error("export names must be UTF-8")]
    NotUtf8,
    #[error("export names may not hold control characters")]
    Control,
    #[error("export names have no empty, `.` or `..` segment between `/`s")]
    Segment,
}

/// The export name `raw` spells, if it is one: at most 4096 bytes (the
/// spec's limit), UTF-8 (the spec's rule, and what policy globs match),
/// with no NUL and no other control character (C0, DEL, C1).
pub fn export_name(raw: &[u8]) -> Result<&str, NameError> {
    if raw.len() > MAX_EXPORT_NAME {
        return Err(NameError::TooLong(raw.len()));
    }
    // Checked on the bytes first: a NUL is the one that truncates a name
    // in C servers, whatever else is wrong with it.
    if raw.contains(&0) {
        return Err(NameError::Nul);
    }
    let name = std::str::from_utf8(raw).map_err(|_| NameError::NotUtf8)?;
    if name.chars().any(char::is_control) {
        return Err(NameError::Control);
    }
    // `/` separates tenants (a templated policy rule binds one whole
    // segment), and a server behind `--upstream` may take a name as a
    // path: so no segment is empty, `.` or `..` (a `*` segment would
    // otherwise grant `team/..`). The default export `""` stays.
    if !name.is_empty()
        && name
            .split('/')
            .any(|segment| segment.is_empty() || segment == "." || segment == "..")
    {
        return Err(NameError::Segment);
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_are_refused_for_nul_invalid_utf8_control_characters_and_length() {
        assert_eq!(export_name(b""), Ok(""));
        assert_eq!(export_name(b"vm-1"), Ok("vm-1"));
        assert_eq!(export_name("disque-été ☃".as_bytes()), Ok("disque-été ☃"));
        assert_eq!(export_name(b"\0-public"), Err(NameError::Nul));
        assert_eq!(export_name(b"\0\xff-public"), Err(NameError::Nul));
        assert_eq!(export_name(b"x-public\0"), Err(NameError::Nul));
        assert_eq!(export_name(b"\xff-public"), Err(NameError::NotUtf8));
        // An overlong encoding of NUL is not UTF-8 either.
        assert_eq!(export_name(b"\xc0\x80-public"), Err(NameError::NotUtf8));
        for control in ["a\n-public", "\x1b[2J", "tab\there", "del\x7f", "c1\u{85}"] {
            assert_eq!(
                export_name(control.as_bytes()),
                Err(NameError::Control),
                "{control:?}"
            );
        }
        for odd in [
            ".", "..", "/", "a/", "/a", "a//b", "team/..", "team/.", "../team", "a/./b",
        ] {
            assert_eq!(
                export_name(odd.as_bytes()),
                Err(NameError::Segment),
                "{odd:?}"
            );
        }
        assert_eq!(export_name(b"team/db"), Ok("team/db"));
        assert_eq!(export_name(b"a.b/.hidden"), Ok("a.b/.hidden"));
        let longest = "v".repeat(MAX_EXPORT_NAME);
        assert_eq!(export_name(longest.as_bytes()), Ok(longest.as_str()));
        let longer = "v".repeat(MAX_EXPORT_NAME + 1);
        assert_eq!(
            export_name(longer.as_bytes()),
            Err(NameError::TooLong(MAX_EXPORT_NAME + 1))
        );
    }

    proptest! {
        #[test]
        fn an_accepted_name_is_the_bytes_unchanged_and_clean(
            raw in proptest::collection::vec(any::<u8>(), 0..64)
        ) {
            match export_name(&raw) {
                Ok(name) => {
                    prop_assert_eq!(name.as_bytes(), &raw[..]);
                    prop_assert!(!name.chars().any(char::is_control));
                }
                Err(NameError::Nul) => prop_assert!(raw.contains(&0)),
                Err(NameError::NotUtf8) => prop_assert!(std::str::from_utf8(&raw).is_err()),
                Err(NameError::Control) => {
                    let text = std::str::from_utf8(&raw).unwrap();
                    prop_assert!(text.chars().any(char::is_control));
                }
                Err(NameError::Segment) => {
                    let text = std::str::from_utf8(&raw).unwrap();
                    prop_assert!(text.split('/').any(|s| s.is_empty() || s == "." || s == ".."));
                }
                Err(NameError::TooLong(_)) => prop_assert!(false, "64 bytes are not too long"),
            }
        }

        #[test]
        fn printable_segments_are_always_a_name(
            segments in proptest::collection::vec("[^\\p{Cc}/]{1,12}", 1..4)
        ) {
            prop_assume!(segments.iter().all(|s| s != "." && s != ".."));
            let name = segments.join("/");
            prop_assert_eq!(export_name(name.as_bytes()), Ok(name.as_str()));
        }
    }
}
