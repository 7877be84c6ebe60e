//! How a [`ClusterView`] and a member's liveness record are written in etcd: JSON, so that an
//! operator can read them with `etcdctl get`.

use gpucache_dataplane::shard::{ClusterView, MemberState, NodeId, ViewMember};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct MemberRecord {
    node: u64,
    address: String,
    fault_domain: String,
    capacity: u64,
    node_epoch: u64,
    state: String,
}

#[derive(Serialize, Deserialize)]
struct ViewRecord {
    epoch: u64,
    members: Vec<MemberRecord>,
}

impl From<&ViewMember> for MemberRecord {
    fn from(m: &ViewMember) -> Self {
        Self {
            node: m.node.0,
            address: m.address.clone(),
            fault_domain: m.fault_domain.clone(),
            capacity: m.capacity,
            node_epoch: m.node_epoch,
            state: m.state.name().to_owned(),
        }
    }
}

impl TryFrom<MemberRecord> for ViewMember {
    type Error = String;

    fn try_from(m: MemberRecord) -> Result<Self, String> {
        let state = MemberState::from_name(&m.state)
            .ok_or_else(|| format!("member {}: unknown state {:?}", m.node, m.state))?;
        Ok(Self {
            node: NodeId(m.node),
            address: m.address,
            fault_domain: m.fault_domain,
            capacity: m.capacity,
            node_epoch: m.node_epoch,
            state,
        })
    }
}

pub(crate) fn encode_view(view: &ClusterView) -> Vec<u8> {
    let record = ViewRecord {
        epoch: view.epoch,
        members: view.members.iter().map(MemberRecord::from).collect(),
    };
    serde_json::to_vec(&record).expect("a view always serializes")
}

pub(crate) fn decode_view(bytes: &[u8]) -> Result<ClusterView, String> {
    let record: ViewRecord = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let members =
        record.members.into_iter().map(ViewMember::try_from).collect::<Result<Vec<_>, _>>()?;
    Ok(ClusterView::new(record.epoch, members))
}

pub(crate) fn encode_member(member: &ViewMember) -> Vec<u8> {
    serde_json::to_vec(&MemberRecord::from(member)).expect("a member always serializes")
}

pub(crate) fn decode_member(bytes: &[u8]) -> Result<ViewMember, String> {
    let record: MemberRecord = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    ViewMember::try_from(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(node: u64, state: MemberState) -> ViewMember {
        ViewMember {
            node: NodeId(node),
            address: format!("127.0.0.1:{}", 7000 + node),
            fault_domain: format!("rack-{}", node % 2),
            capacity: node << 30,
            node_epoch: node * 10,
            state,
        }
    }

    #[test]
    fn a_view_reads_back_as_written() {
        let view = ClusterView::new(
            7,
            [member(3, MemberState::Serving), member(1, MemberState::Draining)],
        );
        let back = decode_view(&encode_view(&view)).expect("decodes");
        assert_eq!(back, view);
        assert_eq!(back.members[0].node, NodeId(1), "members come back sorted");
        let m = member(9, MemberState::Serving);
        assert_eq!(decode_member(&encode_member(&m)).expect("decodes"), m);
    }

    #[test]
    fn a_record_with_an_unknown_state_is_refused() {
        let bad = br#"{"epoch":1,"members":[{"node":1,"address":"a:1","fault_domain":"d","capacity":1,"node_epoch":1,"state":"asleep"}]}"#;
        let e = decode_view(bad).expect_err("unknown state");
        assert!(e.contains("asleep"), "{e}");
        assert!(decode_view(b"{").is_err());
    }
}
