//! Every rank prints its rank and the job size.
//!
//! `cargo run --example hello` runs 4 in-process ranks; `cargo run --example hello -- 16` runs 16.

use rankweave::prelude::*;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let n = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("the rank count must be a number"))
        .unwrap_or(4);
    let lines = rankweave::local(n, |comm| async move {
        // Line the ranks up so the output comes out in rank order.
        comm.barrier().await?;
        Ok::<_, Error>(format!(
            "hello from rank {} of {}",
            comm.rank(),
            comm.size()
        ))
    })
    .await?;
    for line in lines {
        println!("{}", line?);
    }
    Ok(())
}
