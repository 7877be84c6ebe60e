//! The membership changes, as pure functions of a view: each returns the next view (epoch + 1),
//! none when the change would change nothing, or the rule it breaks. The coordinator applies
//! them with a compare-and-swap on the view, so two changes never both start from one view.

use gpucache_dataplane::shard::{ClusterView, ControlError, MemberState, NodeId, ViewMember};

/// The result of one change: the next view, or none when nothing would change.
pub type Change = Result<Option<ClusterView>, ControlError>;

/// A node (re)joins: listed as `member`, replacing an earlier entry of the same node (a new
/// life of it, with a larger node epoch).
pub fn join(view: &ClusterView, member: &ViewMember) -> Change {
    if view.member(member.node) == Some(member) {
        return Ok(None);
    }
    Ok(Some(view.next(|members| {
        members.retain(|m| m.node != member.node);
        members.push(member.clone());
    })))
}

/// A node leaves (it stopped, or its registration lapsed). Never the last member; a node that
/// is not listed changes nothing.
pub fn remove(view: &ClusterView, node: NodeId) -> Change {
    if view.member(node).is_none() {
        return Ok(None);
    }
    if view.members.len() == 1 {
        return Err(ControlError::LastMember { removed: 1 });
    }
    Ok(Some(view.next(|members| members.retain(|m| m.node != node))))
}

/// A life of a node leaves: only when the view still lists that life (`node_epoch`), so that a
/// late notice of an old life never removes the node's new one.
pub fn remove_life(view: &ClusterView, node: NodeId, node_epoch: u64) -> Change {
    match view.member(node) {
        Some(m) if m.node_epoch == node_epoch => remove(view, node),
        _ => Ok(None),
    }
}

/// Starts draining a node for an upgrade: it keeps its keys and admits nothing new.
pub fn drain(view: &ClusterView, node: NodeId) -> Change {
    set_state(view, node, MemberState::Draining)
}

/// Rolls a drain back before it finished: the node admits again.
pub fn undrain(view: &ClusterView, node: NodeId) -> Change {
    set_state(view, node, MemberState::Serving)
}

fn set_state(view: &ClusterView, node: NodeId, state: MemberState) -> Change {
    let member = view.member(node).ok_or(ControlError::UnknownNode(node))?;
    if member.state == state {
        return Ok(None);
    }
    Ok(Some(view.next(|members| {
        for m in members.iter_mut().filter(|m| m.node == node) {
            m.state = state;
        }
    })))
}

/// Finishes a drain: the node leaves the view, and its keys move to their next choices.
pub fn finish(view: &ClusterView, node: NodeId) -> Change {
    let member = view.member(node).ok_or(ControlError::UnknownNode(node))?;
    if member.state != MemberState::Draining {
        return Err(ControlError::NotDraining);
    }
    remove(view, node)
}

/// Removes every member of a fault domain; refused when none is in it, or when it would leave
/// no member.
pub fn isolate(view: &ClusterView, domain: &str) -> Change {
    let removed = view.members.iter().filter(|m| m.fault_domain == domain).count();
    if removed == 0 {
        return Err(ControlError::UnknownDomain(domain.to_owned()));
    }
    if removed == view.members.len() {
        return Err(ControlError::LastMember { removed });
    }
    Ok(Some(view.next(|members| members.retain(|m| m.fault_domain != domain))))
}

/// Rebuilds the view from the members that hold a live registration (`live`), keeping the
/// state each had; always a new epoch, so every fill in flight is fenced.
pub fn rebalance(view: &ClusterView, live: &[ViewMember]) -> Change {
    if live.is_empty() {
        return Err(ControlError::LastMember { removed: view.members.len() });
    }
    let members = live.iter().map(|m| {
        let mut m = m.clone();
        if let Some(listed) = view.member(m.node) {
            m.state = listed.state;
        }
        m
    });
    Ok(Some(ClusterView::new(view.epoch + 1, members)))
}

/// The settled epoch: the least epoch that every live registration has applied, so that no
/// member takes writes under an older view any more. `live` names each live registration by
/// its node and node epoch; `applied` answers the epoch that life of the node last said it
/// applied, none when it has said nothing (counted as 0: a life that has just registered holds
/// the settled epoch back until it says what it applied). 0 when nothing is live.
pub fn settled(
    live: impl IntoIterator<Item = (NodeId, u64)>,
    applied: impl Fn(NodeId, u64) -> Option<u64>,
) -> u64 {
    live.into_iter()
        .map(|(node, node_epoch)| applied(node, node_epoch).unwrap_or(0))
        .min()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(node: u64, domain: &str) -> ViewMember {
        ViewMember {
            node: NodeId(node),
            address: format!("127.0.0.1:{node}"),
            fault_domain: domain.to_owned(),
            capacity: 1 << 30,
            node_epoch: 1,
            state: MemberState::Serving,
        }
    }

    fn view() -> ClusterView {
        ClusterView::new(4, [member(1, "a"), member(2, "a"), member(3, "b")])
    }

    #[test]
    fn every_change_advances_the_epoch_by_one() {
        let v = view();
        let joined = join(&v, &member(4, "b")).unwrap().unwrap();
        assert_eq!((joined.epoch, joined.members.len()), (5, 4));
        assert_eq!(join(&joined, &member(4, "b")).unwrap(), None, "the same entry again");
        let mut again = member(4, "b");
        again.node_epoch = 9;
        let relived = join(&joined, &again).unwrap().unwrap();
        assert_eq!(relived.member(NodeId(4)).unwrap().node_epoch, 9);
        assert_eq!(relived.members.len(), 4);
        let drained = drain(&v, NodeId(2)).unwrap().unwrap();
        assert_eq!(drained.member(NodeId(2)).unwrap().state, MemberState::Draining);
        let finished = finish(&drained, NodeId(2)).unwrap().unwrap();
        assert_eq!((finished.epoch, finished.member(NodeId(2))), (6, None));
        assert_eq!(rebalance(&v, &v.members).unwrap().unwrap().epoch, 5);
    }

    #[test]
    fn the_rules_refuse_what_they_must() {
        let v = view();
        assert_eq!(finish(&v, NodeId(1)), Err(ControlError::NotDraining));
        assert_eq!(drain(&v, NodeId(9)), Err(ControlError::UnknownNode(NodeId(9))));
        assert_eq!(isolate(&v, "z"), Err(ControlError::UnknownDomain("z".into())));
        let one = ClusterView::new(1, [member(1, "a")]);
        assert_eq!(remove(&one, NodeId(1)), Err(ControlError::LastMember { removed: 1 }));
        assert_eq!(isolate(&one, "a"), Err(ControlError::LastMember { removed: 1 }));
        let isolated = isolate(&v, "a").unwrap().unwrap();
        assert_eq!(isolated.placement().nodes(), &[NodeId(3)]);
        assert_eq!(remove(&v, NodeId(9)).unwrap(), None);
        assert_eq!(remove_life(&v, NodeId(1), 2).unwrap(), None, "an older life's notice");
        assert!(remove_life(&v, NodeId(1), 1).unwrap().is_some());
        assert_eq!(rebalance(&v, &[]), Err(ControlError::LastMember { removed: 3 }));
    }

    #[test]
    fn the_settled_epoch_is_the_least_any_live_life_applied() {
        // Node 1's life 1 applied 7, node 2's life 3 applied 5; node 2 also has a record of
        // an earlier life, which does not count for its current one.
        let records = [(1, 1, 7), (2, 3, 5), (2, 2, 9)];
        let applied = |node: NodeId, life: u64| {
            records.iter().find(|(n, l, _)| *n == node.0 && *l == life).map(|(_, _, e)| *e)
        };
        assert_eq!(settled([(NodeId(1), 1), (NodeId(2), 3)], applied), 5);
        assert_eq!(settled([(NodeId(1), 1)], applied), 7);
        assert_eq!(settled([(NodeId(1), 1), (NodeId(2), 2)], applied), 7, "node 2's life 2");
        // A life that has published nothing yet holds everything back.
        assert_eq!(settled([(NodeId(1), 1), (NodeId(2), 4)], applied), 0);
        assert_eq!(settled([(NodeId(1), 2)], applied), 0, "node 1's record is of life 1");
        assert_eq!(settled([], applied), 0, "nothing is live");
    }
}
