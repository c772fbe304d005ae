//! Medians, ratios, Markdown, CSV, and where they go.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::Command;
use std::time::Duration;

use crate::osu;
use crate::plot;
use crate::run::{Config, Gaps, Impl, Plan, Probes, Samples};
use crate::targets;

/// Median, min and max of one size's samples.
#[derive(Clone, Copy, Debug)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

pub fn summarize(v: &[f64]) -> Option<Summary> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    Some(Summary {
        median,
        min: s[0],
        max: s[n - 1],
    })
}

/// rankweave's median over the better MPI's median: below 1 is better for latencies, above 1
/// for bandwidths and rates.
pub fn ratio(bench: &str, rw: f64, mpis: &[f64]) -> Option<f64> {
    let higher = osu::metric(bench).higher_is_better;
    let best = mpis
        .iter()
        .copied()
        .reduce(|a, b| if higher { a.max(b) } else { a.min(b) })?;
    (best > 0.0).then(|| rw / best)
}

fn shell(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{} · {cores} vCPUs · {}", cpu, shell("uname", &["-srm"]))
}

pub fn size_label(size: u64) -> String {
    match size {
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

/// Writes results.md, results.csv and the plots into `plan.out` (and the book's copy).
pub fn write(
    plan: &Plan,
    samples: &Samples,
    gaps: &Gaps,
    probes: &Probes,
    elapsed: Duration,
) -> Result<(), String> {
    let out = &plan.out;
    std::fs::create_dir_all(out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    let plots = plot::all(plan, samples, out)?;
    let run = Run {
        samples,
        gaps,
        probes,
        elapsed,
    };
    let md = markdown(plan, &run, &plots, "");
    std::fs::write(out.join("results.md"), &md).map_err(|e| e.to_string())?;
    std::fs::write(out.join("results.csv"), csv(samples)).map_err(|e| e.to_string())?;
    print!("{md}");
    eprintln!(
        "wrote {}/results.md, results.csv and {} plots",
        out.display(),
        plots.len()
    );
    if plan.book {
        let dir = plan.root.join("book/src/performance");
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        for p in &plots {
            std::fs::copy(out.join(p), dir.join(p)).map_err(|e| e.to_string())?;
        }
        let md = markdown(plan, &run, &plots, "performance/");
        std::fs::write(dir.join("results.md"), md).map_err(|e| e.to_string())?;
        eprintln!("updated {}", dir.display());
    }
    Ok(())
}

/// Writes `<name>.md` and `<name>.csv` into `plan.out`, prints the Markdown, and with `--book`
/// puts the Markdown into the book's performance chapter too (the start-up and multicast
/// reports, which have no plots).
pub fn write_table(plan: &Plan, name: &str, md: &str, csv: &str) -> Result<(), String> {
    let out = &plan.out;
    std::fs::create_dir_all(out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    std::fs::write(out.join(format!("{name}.md")), md).map_err(|e| e.to_string())?;
    std::fs::write(out.join(format!("{name}.csv")), csv).map_err(|e| e.to_string())?;
    print!("{md}");
    eprintln!("wrote {}/{name}.md and {name}.csv", out.display());
    if plan.book {
        let dir = plan.root.join("book/src/performance");
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        std::fs::write(dir.join(format!("{name}.md")), md).map_err(|e| e.to_string())?;
        eprintln!("updated {}", dir.display());
    }
    Ok(())
}

fn csv(samples: &Samples) -> String {
    let mut s = String::from("config,benchmark,implementation,size,median,min,max,rounds\n");
    for ((config, bench, imp), by_size) in samples {
        for (size, v) in by_size {
            if let Some(m) = summarize(v) {
                let _ = writeln!(
                    s,
                    "{},{},{},{},{},{},{},{}",
                    config.name(),
                    bench,
                    imp.name(),
                    size,
                    m.median,
                    m.min,
                    m.max,
                    v.len()
                );
            }
        }
    }
    s
}

/// One line naming the commit, date and machine of a run.
pub fn provenance() -> String {
    let commit = shell("git", &["rev-parse", "--short", "HEAD"]);
    format!(
        "Commit `{commit}`, {}, {}.",
        shell("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        machine()
    )
}

/// What one comparison run gathered.
struct Run<'a> {
    samples: &'a Samples,
    gaps: &'a Gaps,
    probes: &'a Probes,
    elapsed: Duration,
}

fn markdown(plan: &Plan, run: &Run<'_>, plots: &[String], image_prefix: &str) -> String {
    let Run {
        samples,
        gaps,
        probes,
        elapsed,
    } = *run;
    let mut s = String::new();
    let commit = shell(
        "git",
        &[
            "-C",
            &plan.root.to_string_lossy(),
            "rev-parse",
            "--short",
            "HEAD",
        ],
    );
    let _ = writeln!(
        s,
        "<!-- generated by bench/compare; do not edit by hand -->"
    );
    let _ = writeln!(s, "| | |\n|---|---|");
    let _ = writeln!(s, "| commit | `{commit}` |");
    let _ = writeln!(
        s,
        "| date | {} |",
        shell("date", &["-u", "+%Y-%m-%d %H:%M UTC"])
    );
    let _ = writeln!(s, "| machine | {} |", machine());
    let _ = writeln!(
        s,
        "| MPICH | {} |",
        shell("mpichversion", &[])
            .replace("MPICH Version:", "")
            .trim()
    );
    let _ = writeln!(s, "| Open MPI | {} |", shell("ompi_info", &["--version"]));
    let _ = writeln!(
        s,
        "| rounds | {} interleaved (rankweave, MPICH, Open MPI, then again), medians with min–max |",
        plan.rounds
    );
    let _ = writeln!(
        s,
        "| iterations | {} |",
        if plan.quick {
            "smoke run (10)"
        } else {
            "OSU defaults; oversubscribed: 100, warm-up 10, up to 1 KiB; 20, warm-up 2, 64 KiB to 1 MiB; barriers 1000, warm-up 100"
        }
    );
    let _ = writeln!(s, "| took | {:.0?} |", elapsed);
    let _ = writeln!(s, "| placement probe | {} |\n", probe_summary(probes));

    let targets = targets::table(samples);
    if !targets.is_empty() {
        let _ = writeln!(s, "### Targets\n");
        let _ = writeln!(
            s,
            "The cells the shared-memory and collectives issues set targets for, judged as in the \
             summary below (ratios: medians over the rounds of each round's ratio to the better \
             MPI; absolute targets: rankweave's median).\n"
        );
        let _ = writeln!(s, "{targets}");
    }
    let _ = writeln!(s, "### Summary: rankweave against the better MPI\n");
    let _ = writeln!(
        s,
        "Ratio = the median over the rounds of rankweave's result / the better MPI's in the same \
         round (each round runs the three back to back, so drift of the machine between rounds \
         cancels). For latencies below 1.00 means rankweave is faster; for bandwidths and \
         message rates above 1.00 does.\n"
    );
    let _ = writeln!(
        s,
        "| config | benchmark | unit | 1 B | 1 KiB | 64 KiB | 1 MiB | all sizes (geo. mean) |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for &config in &plan.configs {
        for bench in &plan.benches {
            let Some(ratios) = ratios(samples, config, bench) else {
                continue;
            };
            let at = |size: u64| {
                ratios
                    .get(&size)
                    .or_else(|| (size == 1).then(|| ratios.get(&0)).flatten())
                    .map_or("–".to_string(), |r| format!("{r:.2}"))
            };
            let geo = (ratios.values().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp();
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {:.2} |",
                config.name(),
                bench,
                osu::metric(bench).unit,
                at(1),
                at(1024),
                at(64 << 10),
                at(1 << 20),
                geo
            );
        }
    }
    if !gaps.is_empty() {
        let _ = writeln!(s, "\n### Not measured\n");
        for ((config, bench, imp), why) in gaps {
            let _ = writeln!(
                s,
                "- {} / {} / {}: {}",
                config.name(),
                bench,
                imp.name(),
                why
            );
        }
    }
    for &config in &plan.configs {
        for bench in &plan.benches {
            let rows = detail_rows(samples, config, bench);
            if rows.is_empty() {
                continue;
            }
            let m = osu::metric(bench);
            let _ = writeln!(s, "\n### {} — {} ({})\n", config.name(), bench, m.unit);
            let plot = plot::file_name(config, bench);
            if plots.contains(&plot) {
                let _ = writeln!(s, "![{} {}]({image_prefix}{plot})\n", config.name(), bench);
            }
            if let Some(ns) = probes.get(&(config, bench.to_string())) {
                let each: Vec<String> = ns.iter().map(|v| format!("{v:.0}")).collect();
                let _ = writeln!(
                    s,
                    "Placement probe before each round's runs: {} ns.\n",
                    each.join(", ")
                );
            }
            let _ = writeln!(
                s,
                "| size | rankweave | MPICH | Open MPI | ratio |\n|---|---|---|---|---|"
            );
            s.push_str(&rows);
        }
    }
    s
}

/// The header line on the placement probes: their median and range over the whole run.
fn probe_summary(probes: &Probes) -> String {
    let all: Vec<f64> = probes.values().flatten().copied().collect();
    match summarize(&all) {
        Some(m) => format!(
            "one-way hand-off of a cache line between threads pinned to CPUs 0 and 1, before each \
             measurement's runs of a round: median {:.0} ns ({:.0}–{:.0}, {} probes); the vCPUs \
             sit close when it is a few dozen ns, far apart at several times that",
            m.median,
            m.min,
            m.max,
            all.len()
        ),
        None => "not taken (two CPUs could not be pinned)".to_string(),
    }
}

/// size → ratio, where rankweave and at least one MPI have numbers.
pub fn ratios(samples: &Samples, config: Config, bench: &str) -> Option<BTreeMap<u64, f64>> {
    let get = |imp| samples.get(&(config, bench.to_string(), imp));
    let rw = get(Impl::Rankweave)?;
    let mut out = BTreeMap::new();
    for (size, v) in rw {
        let mpis: Vec<&Vec<f64>> = [Impl::Mpich, Impl::OpenMpi]
            .into_iter()
            .filter_map(|i| get(i)?.get(size))
            .collect();
        if let Some(x) = paired_ratio(bench, v, &mpis) {
            out.insert(*size, x);
        }
    }
    (!out.is_empty()).then_some(out)
}

/// The ratio of rankweave's samples `rw` to the MPIs' at one size. When every implementation
/// has one sample per round (the usual case), the median over the rounds of each round's
/// ratio: the three runs of a round follow each other within seconds, so a drift of the VM's
/// placement between rounds (2–8× here) scales a round's runs alike and cancels in its ratio,
/// where the ratio of separate medians could pair a fast rankweave round with slow MPI rounds
/// or the reverse. Otherwise (a round missing somewhere) the ratio of the medians.
fn paired_ratio(bench: &str, rw: &[f64], mpis: &[&Vec<f64>]) -> Option<f64> {
    let paired = !rw.is_empty() && !mpis.is_empty() && mpis.iter().all(|m| m.len() == rw.len());
    if paired {
        let per_round: Vec<f64> = (0..rw.len())
            .filter_map(|i| {
                let theirs: Vec<f64> = mpis.iter().map(|m| m[i]).collect();
                ratio(bench, rw[i], &theirs)
            })
            .collect();
        if per_round.len() == rw.len() {
            return summarize(&per_round).map(|s| s.median);
        }
    }
    let theirs: Vec<f64> = mpis
        .iter()
        .filter_map(|m| summarize(m).map(|s| s.median))
        .collect();
    ratio(bench, summarize(rw)?.median, &theirs)
}

fn detail_rows(samples: &Samples, config: Config, bench: &str) -> String {
    let mut sizes: Vec<u64> = [Impl::Rankweave, Impl::Mpich, Impl::OpenMpi]
        .iter()
        .filter_map(|&i| samples.get(&(config, bench.to_string(), i)))
        .flat_map(|m| m.keys().copied())
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    let ratios = ratios(samples, config, bench).unwrap_or_default();
    let mut s = String::new();
    for size in sizes {
        let cell = |imp| {
            samples
                .get(&(config, bench.to_string(), imp))
                .and_then(|m| m.get(&size))
                .and_then(|v| summarize(v))
                .map_or("–".to_string(), |m| {
                    format!("{:.2} ({:.2}–{:.2})", m.median, m.min, m.max)
                })
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} |",
            size_label(size),
            cell(Impl::Rankweave),
            cell(Impl::Mpich),
            cell(Impl::OpenMpi),
            ratios
                .get(&size)
                .map_or("–".to_string(), |r| format!("{r:.2}"))
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_ratios() {
        let m = summarize(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((m.median, m.min, m.max), (2.0, 1.0, 3.0));
        assert_eq!(summarize(&[1.0, 4.0]).unwrap().median, 2.5);
        assert!(summarize(&[]).is_none());
        // Latency: against the faster MPI.
        assert_eq!(ratio("latency", 1.0, &[2.0, 4.0]), Some(0.5));
        // Bandwidth: against the higher one.
        assert_eq!(ratio("bw", 1.0, &[2.0, 4.0]), Some(0.25));
        assert_eq!(ratio("bw", 1.0, &[]), None);
        // Paired by round: round 2 ran slow for everyone, and its ratio is like round 1's; the
        // ratio of the medians would pair rankweave's slow round with the MPIs' fast ones.
        let rw = vec![1.0, 4.0, 1.1];
        let (mpich, ompi) = (vec![2.0, 8.0, 2.0], vec![0.5, 2.0, 0.55]);
        assert_eq!(paired_ratio("latency", &rw, &[&mpich, &ompi]), Some(2.0));
        let unpaired = vec![2.0, 8.0];
        assert_eq!(paired_ratio("latency", &rw, &[&unpaired]), Some(1.1 / 5.0));
        assert_eq!(size_label(1 << 20), "1 MiB");
        assert_eq!(size_label(65536), "64 KiB");
        assert_eq!(size_label(3), "3 B");
    }
}
