//! `AsyncWrite` for a stream wrapper that changes only how it reads
//! (`conn::prefixed::Prefixed`, `tls::handover::tail::RecordTail`,
//! `conn::kernel_tls::RecordAligned`): every write goes to the inner
//! stream as it is. One definition, so that a fix to one (vectored
//! writes, say) cannot miss the others.

/// `write_through!([generics] Type, field)` implements `AsyncWrite` for
/// `Type` by passing every call to `self.field`.
macro_rules! write_through {
    ([$($g:tt)*] $ty:ty, $field:ident) => {
        impl<$($g)*> tokio::io::AsyncWrite for $ty {
            fn poll_write(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                b: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.get_mut().$field).poll_write(cx, b)
            }

            fn poll_write_vectored(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.get_mut().$field).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.$field.is_write_vectored()
            }

            fn poll_flush(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.get_mut().$field).poll_flush(cx)
            }

            fn poll_shutdown(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.get_mut().$field).poll_shutdown(cx)
            }
        }
    };
}

pub(crate) use write_through;
